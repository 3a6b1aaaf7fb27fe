"""Writes the Triton model repository of docs/MODEL_REPOSITORY.md for a spec.

The repository is assembled in a sibling temporary directory, verified with the same checks as
``engine-build verify``, and only then renamed into place: a failure at any point leaves the
previous repository (or nothing) behind, never a half-written one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from engine_build import pbtxt, runner, runtime
from engine_build.checkpoint import content_fingerprint, fingerprint_tree, read_json, read_shape_for
from engine_build.errors import BuildError, SpecError
from engine_build.hf_config import read_config
from engine_build.spec import BuildSpec, validate
from engine_build.speculative import DECODING_MODE, DRAFT_MODEL_NAME, choices_text
from engine_build.tokenizer_info import TOKENIZER_INFO_FILE, stop_token_ids, write_tokenizer_info
from engine_build.verify import cross_check_engine, engine_limits, verify_repository

# What the gateway loads; tokenizer.json is mandatory, the rest is copied when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "config.json",
    "tokenizer.model",
)


def guided_decoding(spec: BuildSpec, model_dir: Path) -> pbtxt.GuidedDecoding | None:
    """Where the model published at ``model_dir`` has its tokenizer for guided decoding; None
    when the spec turns guided decoding off."""
    if not spec.guided_decoding:
        return None
    tokenizer = model_dir / "tokenizer"
    return pbtxt.GuidedDecoding(str(tokenizer), str(tokenizer / TOKENIZER_INFO_FILE))


def speculative_params(spec: BuildSpec) -> tuple[tuple[str, str], ...]:
    """The target model's speculative parameters: what the backend reads for the mode, and the
    mode and draft length for the gateway and `verify` (the backend ignores those two)."""
    s = spec.speculative
    if not s.on:
        return ()
    params = [
        ("speculative_decoding_mode", s.mode),
        ("max_draft_len", str(s.draft_len)),
        # The backend keeps fast logits only in orchestrator mode without spawned processes.
        ("speculative_decoding_fast_logits", "false"),
    ]
    if s.mode in DECODING_MODE:
        params.append(("decoding_mode", DECODING_MODE[s.mode]))
    if s.mode == "medusa":
        params.append(("medusa_choices", choices_text(s.medusa_choices)))
    if s.mode == "eagle":
        params.append(("eagle_choices", choices_text(s.eagle_choices)))
    if s.mode == "lookahead":
        params += [
            ("lookahead_window_size", str(s.lookahead_window_size)),
            ("lookahead_ngram_size", str(s.lookahead_ngram_size)),
            ("lookahead_verification_set_size", str(s.lookahead_verification_set_size)),
        ]
    if s.mode == "draft_target":
        params.append(("speculative_draft_model", DRAFT_MODEL_NAME))
    return tuple(params)


def draft_kv_tokens(spec: BuildSpec) -> int:
    """KV tokens the draft model reserves: one sequence of max_seq_len in whole blocks."""
    blocks = -(-spec.max_seq_len // spec.tokens_per_block)
    return blocks * spec.tokens_per_block * spec.max_batch_size


def draft_repo_params(spec: BuildSpec) -> pbtxt.RepoParams:
    """The draft model (``tensorrt_llm_draft``) of draft-target speculation: the target's
    settings on the draft engine, its KV pool capped at one sequence
    (``max_tokens_in_paged_kv_cache``) so the target keeps the rest of the memory."""
    base = repo_params(spec, spec.draft_engine_dir, spec.work_dir, hf_only=True)
    return pbtxt.RepoParams(
        **{
            **base.__dict__,
            "name": DRAFT_MODEL_NAME,
            "engine_dir": str(spec.draft_engine_dir),
            "guided_decoding": None,
            "speculative": (("speculative_decoding_fast_logits", "false"),),
            "max_tokens_in_paged_kv_cache": draft_kv_tokens(spec),
            "hf_model_dir": str(spec.speculative.draft_hf_model_dir),
        }
    )


def repo_params(
    spec: BuildSpec, engine_dir: Path | None, model_dir: Path, hf_only: bool = False
) -> pbtxt.RepoParams:
    """The repository's parameters; ``model_dir`` is where its model will be published (absolute;
    guided decoding's paths point into it). Speculation is the engine's (not ``hf_only``)."""
    speculative = () if hf_only or engine_dir is None else speculative_params(spec)
    return pbtxt.RepoParams(
        speculative=speculative,
        draft_inputs=spec.speculative.mode == "draft_target" and bool(speculative),
        draft_logits=spec.speculative.use_draft_logits and bool(speculative),
        max_batch_size=spec.max_batch_size,
        max_input_len=spec.max_input_len,
        max_seq_len=spec.max_seq_len,
        tokens_per_block=spec.tokens_per_block,
        kv_cache_free_gpu_mem_fraction=spec.kv_cache_free_gpu_mem_fraction,
        enable_kv_cache_reuse=spec.enable_kv_cache_reuse,
        cuda_graph_mode=spec.cuda_graph_mode,
        cuda_graph_cache_size=spec.cuda_graph_cache_size,
        cancellation_check_period_ms=spec.cancellation_check_period_ms,
        exclude_input_in_output=spec.exclude_input_in_output,
        gpu_device_ids=spec.gpu_ids,
        hf_model_dir=str(spec.hf_model_dir),
        engine_dir=str(engine_dir) if engine_dir is not None else None,
        guided_decoding=guided_decoding(spec, model_dir),
        attention_window=spec.engine_max_seq_len if speculative else None,
    )


def engine_fingerprint(spec: BuildSpec, engine_dir: Path | None) -> str:
    """What the gateway keys its caches on: it changes whenever generated tokens could.

    For an engine, the build stamp (checkpoint + argv + TensorRT-LLM version) when present, else
    the engine files' identity; for an HF-only repository, the checkpoint's identity.
    """
    if engine_dir is None:
        return hf_fingerprint(spec.hf_model_dir)
    h = hashlib.sha256()
    stamp = runner.read_stamp(engine_dir)
    h.update(b"engine\0" + (stamp or fingerprint_tree(engine_dir)).encode())
    return h.hexdigest()


def hf_fingerprint(hf_model_dir: Path) -> str:
    """The engine_fingerprint of a repository served from the checkpoint itself (``--hf-only``):
    its contents, so every host serving the same checkpoint shares cache entries."""
    h = hashlib.sha256()
    h.update(b"hf\0" + content_fingerprint(hf_model_dir).encode())
    return h.hexdigest()


def _copy_tokenizer(spec: BuildSpec, dest: Path) -> None:
    if not (spec.hf_model_dir / "tokenizer.json").is_file():
        raise BuildError(
            f"{spec.hf_model_dir / 'tokenizer.json'} missing: the gateway needs a fast tokenizer"
        )
    dest.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        src = spec.hf_model_dir / name
        if src.is_file():
            shutil.copy2(src, dest / name)


def write_repository(
    spec: BuildSpec, output: Path, hf_only: bool = False, force: bool = False
) -> Path:
    """Write ``output`` for the spec's engine (or, with ``hf_only``, for its HF checkpoint)."""
    output = Path(output).absolute()
    _refuse_output_over_sources(spec, output)
    read_shape_for(spec)
    engine_dir: Path | None = None
    limits: dict[str, Any] = {}
    if not hf_only:
        runtime.require_single_gpu(spec)
        engine_dir = spec.engine_dir
        if not (engine_dir / "config.json").is_file():
            raise BuildError(
                f"no engine in {engine_dir}: run `engine-build build` first, or pass --hf-only "
                "for the engine server"
            )
        limits = engine_limits(read_json(engine_dir / "config.json", "engine config.json"))
        expected = {
            "max_batch_size": spec.max_batch_size,
            "max_input_len": spec.max_input_len,
            # trtllm-build adds the draft length (and EAGLE's layers) to max_seq_len.
            "max_seq_len": spec.engine_max_seq_len,
            "max_draft_len": spec.speculative.draft_len,
        }
        for key, want in expected.items():
            if limits[key] != want:
                raise BuildError(
                    f"engine {engine_dir} was built with {key} {limits[key]} but the spec says "
                    f"{want}: rebuild with `engine-build build`"
                )
    if output.exists() and not force:
        raise BuildError(f"{output} exists; pass --force to replace it")
    if not output.parent.is_dir():
        raise BuildError(f"{output}: the folder {output.parent} does not exist; create it first")
    tmp = output.with_name(f".{output.name}.partial-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        model_dir = tmp / pbtxt.MODEL_NAME
        (model_dir / "1").mkdir(parents=True)
        cfg = pbtxt.model_config(repo_params(spec, engine_dir, output / pbtxt.MODEL_NAME))
        if engine_dir is not None:
            params = {k: v.string_value for k, v in cfg.parameters.items()}
            mismatch = cross_check_engine(cfg, params, limits)
            if mismatch:
                raise BuildError(f"engine {engine_dir} does not match the spec: {mismatch[0]}")
        (model_dir / "config.pbtxt").write_text(pbtxt.render(cfg), encoding="utf-8")
        _copy_tokenizer(spec, model_dir / "tokenizer")
        if engine_dir is not None and spec.speculative.mode == "draft_target":
            _write_draft_model(spec, tmp)
        if spec.guided_decoding:
            tokenizer = model_dir / "tokenizer"
            write_tokenizer_info(
                tokenizer / "tokenizer.json",
                stop_token_ids(spec.hf_model_dir),
                tokenizer / TOKENIZER_INFO_FILE,
            )
        (model_dir / "engine_fingerprint").write_text(
            engine_fingerprint(spec, engine_dir) + "\n", encoding="utf-8"
        )
        problems = verify_repository(tmp, published_as=output)
        if problems:
            raise BuildError(f"refusing to publish {output}: {problems[0]}")
        if output.exists():
            old = output.with_name(f".{output.name}.old-{os.getpid()}")
            output.rename(old)
            tmp.rename(output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(output)
    except OSError as err:
        # The repository is staged in a hidden folder beside `output`; name `output` instead.
        where = Path(err.filename) if err.filename else output
        if where == tmp or where.is_relative_to(tmp):
            where = output / where.relative_to(tmp)
        raise OSError(err.errno, err.strerror, str(where)) from err
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return output


def _refuse_output_over_sources(spec: BuildSpec, output: Path) -> None:
    """Refuse an output that is, or holds, what the repository is made from: replacing it
    (--force) would delete the engine or checkpoint the new repository names."""
    s = spec.speculative
    sources = [
        ("work directory (engine, checkpoint)", spec.work_dir),
        ("engine", spec.engine_dir),
        ("draft engine", spec.draft_engine_dir),
        ("checkpoint", spec.hf_model_dir),
        ("draft checkpoint", s.draft_hf_model_dir),
        ("Medusa heads", s.medusa_model_dir),
        ("EAGLE drafter", s.eagle_model_dir),
    ]
    resolved = output.resolve()
    for what, path in sources:
        if path is not None and Path(path).resolve().is_relative_to(resolved):
            raise SpecError(
                f"--output {output} holds the {what} {path} the repository is made from; "
                "write the repository to another folder"
            )


def _write_draft_model(spec: BuildSpec, tmp: Path) -> None:
    draft_engine = spec.draft_engine_dir
    if not (draft_engine / "config.json").is_file():
        raise BuildError(f"no draft engine in {draft_engine}: run `engine-build build` first")
    limits = engine_limits(read_json(draft_engine / "config.json", "draft engine config.json"))
    cfg = pbtxt.model_config(draft_repo_params(spec))
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    mismatch = cross_check_engine(cfg, params, limits)
    if mismatch:
        raise BuildError(f"draft engine {draft_engine} does not match the spec: {mismatch[0]}")
    (tmp / DRAFT_MODEL_NAME / "1").mkdir(parents=True)
    (tmp / DRAFT_MODEL_NAME / "config.pbtxt").write_text(pbtxt.render(cfg), encoding="utf-8")


def write_hf_repository(
    hf_model_dir: Path,
    output: Path,
    max_seq_len: int | None = None,
    guided_decoding: bool = True,
) -> Path:
    """``engine-build repo --hf-only`` without a spec file: what the model makers call.

    The limits default to the checkpoint's whole context (max_seq_len = max_position_embeddings,
    inputs up to one token less); the other settings are the spec's defaults, so the repository
    is the one an operator's minimal spec would produce, except that prefix reuse is on: the
    engine server reuses KV blocks without the paged-context kernel a TensorRT engine needs for it
    (the backend's own default when the parameter is unset). An existing ``output`` is replaced.
    ``guided_decoding`` False writes a repository without guided decoding (the engine server then
    never imports xgrammar).
    """
    hf_model_dir = Path(hf_model_dir).resolve()
    seq = max_seq_len or read_config(hf_model_dir).max_position_embeddings
    spec = BuildSpec(
        source=hf_model_dir / "config.json",
        hf_model_dir=hf_model_dir,
        work_dir=hf_model_dir,
        max_input_len=seq - 1,
        max_seq_len=seq,
        max_num_tokens=seq - 1,
        enable_kv_cache_reuse=True,
        guided_decoding=guided_decoding,
    )
    validate(spec)
    return write_repository(spec, Path(output), hf_only=True, force=True)
