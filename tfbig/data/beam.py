"""The same preparation on Apache Beam: `tfbig-prep --runner=direct` (or dataflow, spark, flink).

Planning stays on the launching host, exactly as in the local path: pieces, the validation
hold-out, the tokenizer (trained on a sample of the training text, or given), the shard jobs.
Beam then runs `shards.ensure_shard` once per job, on any worker: each worker reads its pieces,
tokenizes, packs, writes `NAME.tmp`, renames it and writes the `.done` sidecar, the same code the
local processes run; a retried bundle reuses a finished shard or rewrites it whole. When the
pipeline has finished, the launching host reads the sidecars and writes manifest.json. So the
shards and the manifest are byte-identical to the local path's.

Workers must see the input files and --output_dir at the same paths (a shared file system:
NFS, Lustre, GCS-FUSE...); shard files are written with ordinary file I/O.

Apache Beam is an optional extra (`pip install tfbig[beam]`): its releases pin protobuf < 7,
pyarrow < 26, pillow < 13 and python-dateutil < 3, older than what TensorFlow 2.20's pinned set
here installs, so it lives in its own environment (prep workers need no TensorFlow).

Example:
    prepare(["pile/*.jsonl.zst"], "/shared/pile", runner="direct", num_workers=4)
"""

from tfbig.data import shards

RUNNERS = {"direct": "DirectRunner", "dataflow": "DataflowRunner", "spark": "SparkRunner",
           "flink": "FlinkRunner", "portable": "PortableRunner"}


def runner_name(runner: str) -> str:
    """Beam's runner class name for a --runner value; ValueError naming the known ones."""
    if runner not in RUNNERS:
        raise ValueError(f"--runner={runner!r}: expected local or one of {sorted(RUNNERS)} (Apache Beam)")
    return RUNNERS[runner]


def write_shards(jobs: list[shards.ShardJob], runner: str, num_workers: int,
                 beam_options: tuple[str, ...] = ()) -> list[dict]:
    """Run every job on Beam; returns their sidecar dicts in job order (as `shards.write_shards`)."""
    options = _pipeline_options(runner, num_workers, beam_options)
    import apache_beam as beam

    with beam.Pipeline(options=options) as pipeline:
        _ = (pipeline
             | "jobs" >> beam.Create(jobs)
             | "spread" >> beam.Reshuffle()  # one job per bundle, spread over the workers
             | "write shard" >> beam.Map(_ensure))
    results = []
    for job in jobs:
        done = shards.completed(job)
        if done is None:
            raise RuntimeError(f"the Beam pipeline finished but {job.path} is missing or does not match its "
                               ".done record; are --output_dir and the inputs on a file system every worker "
                               "shares?")
        results.append(done)
    return results


def _ensure(job: shards.ShardJob) -> str:
    shards.ensure_shard(job)
    return job.file


def _pipeline_options(runner: str, num_workers: int, beam_options: tuple[str, ...]):
    name = runner_name(runner)
    try:
        from apache_beam.options.pipeline_options import PipelineOptions
    except ImportError as error:
        raise ValueError(f"--runner={runner} needs Apache Beam, an optional extra: pip install 'tfbig[beam]' "
                         "in an environment of its own (Beam pins protobuf < 7, older than this TensorFlow "
                         "set's), or use --runner=local") from error
    arguments = [f"--runner={name}", *beam_options]
    if runner == "direct":
        arguments += [f"--direct_num_workers={num_workers}",
                      "--direct_running_mode=" + ("multi_processing" if num_workers > 1 else "in_memory")]
    return PipelineOptions(arguments)
