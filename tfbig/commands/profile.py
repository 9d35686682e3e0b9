"""`tfbig-profile RUN_DIR`: the charts and text report of a profiled run (tfbig.profiling.report)."""
import sys

from tfbig.commands.cli import ArgumentParser
from tfbig.profiling.report import format_report, render


def main(argv=None):
    parser = ArgumentParser(prog="tfbig-profile", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser("report", help="charts and a bottleneck diagnosis of a run")
    report.add_argument("run_dir", help="a tfbig-train --model_dir")
    report.add_argument("--output_dir", default=None,
                        help="where the PNG charts go (default: RUN_DIR/profile)")
    args = parser.parse_args(argv)
    try:
        summary, findings, charts = render(args.run_dir, args.output_dir)
    except (FileNotFoundError, ValueError) as error:
        print(f"tfbig-profile: error: {error}", file=sys.stderr)
        return 2
    print(format_report(summary, findings, charts))
    return 0


def run():
    sys.exit(main())


if __name__ == "__main__":
    run()
