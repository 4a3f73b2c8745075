"""The stored-result form of a scripts/gpu_microbench.sh run: python scripts/microbench_md.py LOGDIR [COMMAND]
writes LOGDIR/result.md (title with the GPU, date, commit, device line, command, the CSV) for
benchmarks/results/<date>-<gpu>-<commit>-microbench.md; the logs line is left for the session to fill in.
Commit and GPU tag as msa.bench names them (msa/_provenance.py, loaded by path: no torch or extension needed);
on the device gpu_microbench.sh sets MSA_COMMIT from the carried .msa_commit, as gpu_check.sh does."""
import datetime
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _provenance():
    spec = importlib.util.spec_from_file_location("msa_provenance", ROOT / "msa" / "_provenance.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def device(log):
    lines = (log / "gpu.txt").read_text().splitlines() if (log / "gpu.txt").is_file() else []
    return lines[1].strip() if len(lines) > 1 else "unknown"


def render(log, commit, command, now, gpu_tag):
    dev = device(log)
    csv = (log / "microbench.csv").read_text().strip()
    rows = len(csv.splitlines()) - 1
    return "\n".join([
        f"# C++ microbenchmarks (benchmarks/cpp), {gpu_tag(dev.split(',')[0]).upper()}",
        "",
        f"- date: {now:%Y-%m-%d %H:%M} UTC",
        f"- commit: {commit}",
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
    prov = _provenance()
    now = datetime.datetime.now(datetime.timezone.utc)
    (log / "result.md").write_text(render(log, prov.git_commit(), command, now, prov.gpu_tag))
    print(log / "result.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
