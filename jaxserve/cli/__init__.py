"""The `jaxserve` command line (`jaxserve.cli.main:main`; `python -m jaxserve.cli`): `serve`, `batch`, `generate`,
`check`, `convert`, `cluster`. Options are parsed and checked here, at the edge; nothing below imports this
package."""
