"""The stored-result form of a scripts/gpu_microbench.sh run: python scripts/microbench_md.py LOGDIR [COMMAND]
writes LOGDIR/result.md (title with the GPU, date, commit, device line, command, the CSV) for
benchmarks/results/<date>-<gpu>-<commit>-microbench.md; the logs line is left for the session to fill in.
The commit comes from .msa_commit (scripts/stamp_commit.sh; the device's copied .git is stale), else git."""
import datetime
import pathlib
import subprocess
import sys


def commit(root):
    stamp = root / ".msa_commit"
    if stamp.is_file() and stamp.read_text().strip():
        return stamp.read_text().strip()
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device(log):
    lines = (log / "gpu.txt").read_text().splitlines() if (log / "gpu.txt").is_file() else []
    return lines[1].strip() if len(lines) > 1 else "unknown"


def short_gpu(dev):
    for tag in ("H200", "H100", "H800", "H20", "GH200", "A100", "B200"):
        if tag in dev.split(",")[0]:
            return tag
    return dev.split(",")[0].strip() or "GPU"


def render(log, root, command, now):
    dev = device(log)
    csv = (log / "microbench.csv").read_text().strip()
    rows = len(csv.splitlines()) - 1
    return "\n".join([
        f"# C++ microbenchmarks (benchmarks/cpp), {short_gpu(dev)}",
        "",
        f"- date: {now:%Y-%m-%d %H:%M} UTC",
        f"- commit: {commit(root)}",
        f"- device: {dev}",
        f"- command: `{command}` ({rows} rows; CUDA events over rotating inputs)",
        "- logs: (the session's logs folder)",
        "",
        "```",
        csv,
        "```",
        "",
    ])


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    log = pathlib.Path(argv[0])
    command = argv[1] if len(argv) > 1 else "scripts/gpu_microbench.sh LOGDIR"
    root = pathlib.Path(__file__).resolve().parent.parent
    now = datetime.datetime.now(datetime.timezone.utc)
    (log / "result.md").write_text(render(log, root, command, now))
    print(log / "result.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
