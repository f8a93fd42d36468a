"""Several processes serving one model under jax.distributed: joining, the step plan's channel and wire format,
the leader's broadcast and the followers' loop, the cluster check. Nothing here parses command lines."""
