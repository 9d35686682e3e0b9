"""`python -m tfbig.commands.consolidate MODEL_DIR OUT_DIR` (also `python -m tfbig.consolidate`):
a sharded run's newest checkpoint as one single-device checkpoint (tfbig.training.consolidate)."""
import sys

from tfbig.training.consolidate import COMMAND, consolidate


def main(argv=None):
    """python -m tfbig.commands.consolidate MODEL_DIR OUT_DIR: errors are one line and exit code 2."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(f"usage: {COMMAND}\nAssemble the newest checkpoint of a --zero_stage, "
              f"--tensor_parallel or --pipeline_stages run into a single-device one.",
              file=sys.stderr)
        return 2
    try:
        path = consolidate(*args)
    except (ValueError, FileNotFoundError) as error:
        print(f"tfbig: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path}: a single-device checkpoint (resumes under any layout, read by "
          f"tfbig-generate/export)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
