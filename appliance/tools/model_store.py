"""A model made on this host (the tiny test model, the converted instruct model) and its repository.

Making a checkpoint costs seconds to a minute, so it is made once and reused: the checkpoint is
written into a temporary sibling and renamed into place whole (a crash never leaves a
half-written one at its final path), then its model repository is written by engine_build's
repository writer, the same one `engine-build repo --hf-only` uses on a GPU host.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from engine_build.pbtxt import MODEL_NAME
from engine_build.repo import hf_fingerprint, write_hf_repository
from engine_build.tokenizer_info import TOKENIZER_INFO_FILE

__all__ = ["ensure_model", "fingerprint_file"]


def fingerprint_file(repo: Path) -> Path:
    return repo / MODEL_NAME / "engine_fingerprint"


def _recorded(repo: Path) -> str | None:
    try:
        return fingerprint_file(repo).read_text(encoding="utf-8").strip()
    except OSError:
        return None


def _has_guided_decoding(repo: Path) -> bool:
    return (repo / MODEL_NAME / "tokenizer" / TOKENIZER_INFO_FILE).is_file()


def ensure_model(
    root: Path,
    make_checkpoint: Callable[[Path], object],
    files: Sequence[str],
    log: Callable[[str], None] = lambda _: None,
    guided_decoding: bool = True,
) -> tuple[Path, Path]:
    """Return (root/model, root/repo), making whatever is missing or stale.

    The checkpoint is remade when one of ``files`` is missing from it, or when the repository
    recorded a different checkpoint identity (the checkpoint changed after it was published);
    a checkpoint without a repository (a crash between the two steps) only gets its repository,
    and so does one whose repository has guided decoding on where ``guided_decoding`` says off,
    or the other way round. ``make_checkpoint(dir)`` writes a complete checkpoint into the empty
    directory it is given.
    """
    root = Path(root)
    model_dir, repo = root / "model", root / "repo"
    recorded = _recorded(repo)
    have_model = all((model_dir / name).is_file() for name in files)
    if have_model and recorded is not None and recorded == hf_fingerprint(model_dir):
        if _has_guided_decoding(repo) == guided_decoding:
            return model_dir, repo
        state = "on" if guided_decoding else "off"
        log(f"writing the model repository {repo} (guided decoding {state})")
        write_hf_repository(model_dir, repo, guided_decoding=guided_decoding)
        return model_dir, repo
    if not have_model or recorded is not None:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".model-", dir=root))
        try:
            make_checkpoint(staging / "model")
            for stale in (repo, model_dir):
                if stale.exists():
                    shutil.rmtree(stale)
            os.replace(staging / "model", model_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log(f"writing the model repository {repo}")
    write_hf_repository(model_dir, repo, guided_decoding=guided_decoding)
    return model_dir, repo
