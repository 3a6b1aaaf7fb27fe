"""A guide's compile tried first in a child process that is killed at a deadline.

xgrammar's compile time is not bounded by the guide's size: each bounded length or repetition
count of a broad character class (`maxLength`, `{0,1000}`) costs seconds with a real vocabulary,
and nesting costs grow with the cube of the depth (a 37 KB schema of 1,000 nested objects runs for
minutes and grows past 7 GiB). A thread running it cannot be stopped, so a guide is compiled in a
process forked from a forkserver (started clean, with xgrammar imported, never a fork of the
engine's CUDA process), under a memory and CPU limit of its own, killed when its deadline passes.
Only a guide that compiled there is compiled again in the engine: the same deterministic work, now
known to end. The child's compiled grammar is not sent back: xgrammar's serialized form of a
grammar that compiles in 0.1 s can be 128 MB and take 10 s to write.

This module imports nothing heavy at its top: the child imports it (and xgrammar) only.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import resource
from multiprocessing.connection import Connection
from typing import Any

# First byte of the child's answer.
_COMPILED = b"C"
_REFUSED = b"R"
_NO_MEMORY = b"M"
# What the child's processes are called (multiprocessing's name, seen in a process listing).
PROCESS_NAME = "guide-compile"


class CompileTimeout(Exception):
    """The compile did not finish by its deadline; its process was killed."""


class CompileMemory(Exception):
    """The compile needed more memory than its limit."""


class CompileFailed(Exception):
    """xgrammar refused the guide; the message is its reason (unprocessed)."""


class CompileCrashed(Exception):
    """The compile's process ended without an answer; the message is its exit code."""


# Imported once in the forkserver. Each child also runs the parent's main script again (as
# multiprocessing does: its top level must not start anything), the `appliance` command's being
# an import of appliance.cli, preloaded here so it costs nothing.
_PRELOAD = ["appliance.cli", "appliance.engine.guide_compile", "xgrammar"]


def start() -> None:
    """Start the forkserver (once per process), with xgrammar and the appliance's CLI imported
    in it, so a compile costs a fork, not an interpreter start."""
    multiprocessing.set_forkserver_preload(_PRELOAD)
    multiprocessing.forkserver.ensure_running()


def compile_in_child(
    tokenizer_json: str, kind: str, text: str, deadline_s: float, memory_bytes: int
) -> None:
    """Compile a guide (kind: json, json_schema, regex or ebnf_grammar) in a child process with
    `memory_bytes` of address space beyond what it starts with; returns once it compiled, raises
    CompileTimeout after `deadline_s`, CompileMemory, CompileFailed or CompileCrashed."""
    start()
    ctx = multiprocessing.get_context("forkserver")
    reader, writer = ctx.Pipe(duplex=False)
    args = (writer, tokenizer_json, kind, text, deadline_s, memory_bytes)
    process = ctx.Process(target=_child, args=args, name=PROCESS_NAME, daemon=True)
    try:
        process.start()
    except OSError as exc:  # the forkserver is gone (or cannot fork)
        reader.close()
        writer.close()
        raise CompileCrashed(f"none: it could not start: {exc.strerror}") from None
    try:
        writer.close()
        if not reader.poll(deadline_s):
            raise CompileTimeout
        try:
            answer = reader.recv_bytes()
        except EOFError:
            process.join(1.0)
            raise CompileCrashed(str(process.exitcode)) from None
    finally:
        reader.close()
        if process.is_alive():
            process.kill()
        process.join()
        process.close()
    tag, body = answer[:1], answer[1:].decode("utf-8", "replace")
    if tag == _NO_MEMORY:
        raise CompileMemory
    if tag != _COMPILED:
        raise CompileFailed(body)


def _child(
    conn: Connection,
    tokenizer_json: str,
    kind: str,
    text: str,
    deadline_s: float,
    memory_bytes: int,
) -> None:
    """The child's work: limits first, then the compile; its answer is one tagged message. A
    limit the sandbox does not let it set is left (the parent's deadline still holds)."""
    try:
        _limit(resource.RLIMIT_AS, _address_space() + memory_bytes)
        # The parent kills the process at the deadline; the CPU limit ends it if the parent cannot.
        _limit(resource.RLIMIT_CPU, int(deadline_s) + 5)
    except (OSError, ValueError):
        pass
    try:
        import xgrammar as xgr

        tokenizer = xgr.TokenizerInfo.deserialize_json(tokenizer_json)
        compiler = xgr.GrammarCompiler(tokenizer, max_threads=1, cache_enabled=False)
        compile_guide(compiler, kind, text)
        answer = _COMPILED
    except MemoryError:
        answer = _NO_MEMORY
    except (RuntimeError, ValueError) as exc:
        # xgrammar raises std::bad_alloc as a RuntimeError of that text.
        answer = _NO_MEMORY if "bad_alloc" in str(exc) else _REFUSED + str(exc).encode()
    conn.send_bytes(answer)
    conn.close()


def compile_guide(compiler: Any, kind: str, text: str) -> Any:
    """The xgrammar CompiledGrammar of a guide, from an xgrammar GrammarCompiler."""
    if kind == "json":
        return compiler.compile_builtin_json_grammar()
    if kind == "json_schema":
        return compiler.compile_json_schema(text)
    if kind == "regex":
        return compiler.compile_regex(text)
    return compiler.compile_grammar(text)


def _address_space() -> int:
    """Bytes of address space this process maps now."""
    with open("/proc/self/statm", encoding="ascii") as statm:
        pages = int(statm.read().split()[0])
    return pages * resource.getpagesize()


def _limit(which: int, soft: int) -> None:
    """Lower a limit's soft value (never above its hard one)."""
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(which, (soft, hard))
