"""`jaxserve batch job.yaml`: OpenAI batch JSONL in, JSONL out, on the engine directly; loss-free and resumable.

  job_config   the YAML job file (pydantic)         input_file   reading and checking the input lines
  endpoints    body <-> engine, via the server's    records      output lines (OpenAI's batch format)
  result_log   durable, resumable result files      runner       continuous batching over the engine
  job          one run end to end (`run_job`)       validate     `--validate`
  command      the CLI subcommand

Nothing is imported here, so `jaxserve batch --help` does not load the server schemas.
"""
