"""A benchmark's markdown report: printed, and written to its file under benchmarks/results/ (folders made)."""

import os


def publish(lines: list[str], path: str) -> None:
    """Print `lines` and write them, one per line, to `path`."""
    report = "\n".join(lines) + "\n"
    print(report, end="")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(report)
