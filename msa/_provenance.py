"""Where a stored result comes from: the commit under test and the GPU's file-name tag. Standard library only, so
scripts that run without torch or the built extension (scripts/microbench_md.py) load this file by its path."""
import os
import re
import subprocess


def git_commit():
    """The commit under test, from git; on a copied tree where git cannot answer, from the .msa_commit
    file that scripts/stamp_commit.sh wrote (carried along with the tree)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.environ.get("MSA_COMMIT"):  # set by scripts/gpu_check.sh from the carried .msa_commit
        return os.environ["MSA_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                   capture_output=True, text=True).stdout.strip()
            return out.stdout.strip() + ("+dirty" if dirty else "")
    except OSError:
        pass
    stamp = os.path.join(root, ".msa_commit")
    return open(stamp).read().strip() if os.path.exists(stamp) else "unknown"


def gpu_tag(name):
    """The file-name tag of a GPU: its model ("NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA H200" -> "h200"), the first
    word that is letters then digits after the vendor, else the last word."""
    words = [w.lower() for w in re.split(r"[\s-]+", name) if w and w.lower() != "nvidia"]
    model = next((w for w in words if re.fullmatch(r"[a-z]+\d+[a-z]*", w)), None)
    return model or (words[-1] if words else "gpu")
