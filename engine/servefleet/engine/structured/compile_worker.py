"""Grammar compiles proven to finish within a request's budget, in a child process first.

xgrammar compiles with the GIL released, so a compile on a worker thread leaves the event loop
answering; but a compile cannot be stopped once started, and some take minutes from a few
bytes (a string of `maxLength` 5000: 6 s; an object of 1,500 optional properties, 40 KB:
over 30 s; a forced choice over 50 tools of 200 properties: ~8 minutes). A thread would keep
burning a core and hold its worker to the end. So a grammar the cache lacks is compiled
first in a child process, which is killed at the deadline (the request is then refused);
once the child has finished in time, the engine compiles it again on its own thread, work
now known to be bounded, and caches it.

Why twice, not once and shipped back: `CompiledGrammar.serialize_json` grows quadratically
with alternatives (a forced choice over 128 tools of 8 properties compiles in 0.24 s and 3 MB,
and serializes to 407 MB in 25 s, plus 13 s to read back), so a compile costs at most twice
its time this way, and a transfer could cost a hundred times it.

Children are forked from multiprocessing's fork server, a fresh interpreter that imports this
module (xgrammar, and torch with it) once: a child replacing a killed one starts in ~40 ms,
not the seconds of an import. A child exits when the engine closes its pipe (or dies).
"""

from __future__ import annotations

import json
import multiprocessing
import queue
import threading
from multiprocessing.connection import Connection
from typing import Any

import xgrammar as xgr

from servefleet.engine.prepare_pool import Budget
from servefleet.engine.structured.constraint import ConstraintError, ConstraintSpec

# JSON as compact as json.dumps writes it: a small model given free whitespace may spend
# its whole budget on newlines inside an object.
_SEPARATORS = (", ", ": ")
STARTUP_TIMEOUT_S = 180.0  # the fork server's first start imports torch (seconds, more if busy)


class CompileTimeout(Exception):
    """The compile outlived its budget; the child that ran it was killed."""


class CompilerUnavailable(RuntimeError):
    """No compile process could be started (not the request's fault)."""


def compile_spec(compiler: xgr.GrammarCompiler, spec: ConstraintSpec) -> xgr.CompiledGrammar:
    """One spec compiled; an invalid schema, regex or grammar is a ConstraintError."""
    try:
        return _compile_kind(compiler, spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        what = {"json_schema": "JSON schema", "regex": "regex", "grammar": "grammar"}
        raise ConstraintError(
            f"invalid {what.get(spec.kind, spec.kind)}: {str(exc).strip()[:500]}", spec.param
        ) from exc


def _compile_kind(compiler: xgr.GrammarCompiler, spec: ConstraintSpec) -> xgr.CompiledGrammar:
    if spec.kind == "json_object":
        return compiler.compile_json_schema(
            '{"type": "object"}', any_whitespace=False, separators=_SEPARATORS
        )
    if spec.kind == "json_schema":
        json.loads(spec.value)  # a clear error for text that is not JSON at all
        return compiler.compile_json_schema(
            spec.value, any_whitespace=False, separators=_SEPARATORS, strict_mode=True
        )
    if spec.kind == "regex":
        return compiler.compile_regex(spec.value)
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        rule = " | ".join(json.dumps(c) for c in choices)
        return compiler.compile_grammar(f"root ::= {rule}")
    return compiler.compile_grammar(spec.value)


def _serve(conn: Connection, tokenizer_info_json: str) -> None:
    """The child: compile each spec it is sent, answer ("ok", "") or ("error", message)."""
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", ""))
    while True:
        try:
            spec = conn.recv()
        except (EOFError, OSError):
            return  # the engine closed the pipe or exited
        try:
            compile_spec(compiler, spec)
        except ConstraintError as exc:
            conn.send(("error", str(exc)))
        else:
            conn.send(("ok", ""))


_context_lock = threading.Lock()


def _context() -> Any:
    with _context_lock:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])  # only read when the fork server starts
        return ctx


class CompileProcess:
    """One child and its pipe; used by one thread at a time."""

    def __init__(self, tokenizer_info_json: str) -> None:
        ctx = _context()
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(child, tokenizer_info_json), name="grammar-compile", daemon=True
        )
        self.process.start()
        child.close()
        if not self.conn.poll(STARTUP_TIMEOUT_S):
            self.kill()
            raise CompilerUnavailable("the grammar compiler did not start in time")
        try:
            self.conn.recv()
        except EOFError:
            self.kill()
            raise CompilerUnavailable("the grammar compiler exited at start") from None

    def try_compile(self, spec: ConstraintSpec, timeout: float) -> None:
        """Returns once the child compiled `spec`; CompileTimeout (child killed) past
        `timeout` seconds, ConstraintError when the spec is invalid."""
        self.conn.send(spec)
        if not self.conn.poll(max(0.0, timeout)):
            self.kill()
            raise CompileTimeout
        try:
            status, payload = self.conn.recv()
        except EOFError:
            self.kill()
            raise ConstraintError(
                "the grammar compiler failed on this constraint", spec.param
            ) from None
        if status == "error":
            raise ConstraintError(payload, spec.param)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class CompilePool:
    """Compile processes shared by the threads that prepare requests: an idle one is reused,
    a new one started when none is idle (so their number is that of concurrent compiles)."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo) -> None:
        self.tokenizer_info = tokenizer_info
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
        self._info_json: str | None = None
        self._idle: queue.SimpleQueue[CompileProcess] = queue.SimpleQueue()
        self._lock = threading.Lock()

    def _take(self) -> CompileProcess:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._info_json is None:
                self._info_json = self.tokenizer_info.serialize_json()
        return CompileProcess(self._info_json)

    def warm_up(self) -> None:
        """Start the fork server and one child ahead of the first constrained request."""
        self._idle.put(self._take())

    def compile(self, spec: ConstraintSpec, budget: Budget) -> xgr.CompiledGrammar:
        """The grammar, once a child compiled it within `budget`. The budget is paused while
        a child starts (the fork server's first start takes seconds) and while the engine
        compiles again what the child has just shown to be bounded: neither is the request's
        doing."""
        with budget.paused():
            process = self._take()
        try:
            process.try_compile(spec, budget.remaining())
        finally:
            if not process.conn.closed:  # a timeout or a crash killed it: never given back
                self._idle.put(process)
        with budget.paused():
            return compile_spec(self.compiler, spec)
