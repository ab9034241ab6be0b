"""Constraint specs -> compiled grammars (cached) -> one matcher per sequence.

Compiling a JSON schema against a 49k-token vocabulary takes milliseconds (see the engine
README); the cache keys compiled grammars by their spec, least recently used out first, so
a client that sends the same schema with every request compiles it once. A compile runs in
a child process with the request's time budget (`compile_worker`), on the thread that prepares
the request, so a bad schema or regex is a 400 before the engine sees it and a compile that
would take minutes is cut at the budget.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import xgrammar as xgr

from servefleet.engine.prepare_pool import Budget
from servefleet.engine.structured.compile_worker import CompilePool
from servefleet.engine.structured.constraint import ConstraintSpec
from servefleet.engine.structured.vocabulary import xgrammar_tokenizer_info
from servefleet.text.tokenizer import Tokenizer

DEFAULT_COMPILE_TIMEOUT_S = 60.0  # callers without a request budget (tests, tools)


class GrammarCache:
    def __init__(self, tokenizer: Tokenizer, max_entries: int = 256) -> None:
        self.pool = CompilePool(xgrammar_tokenizer_info(tokenizer))
        self.max_entries = max_entries
        self._compiled: OrderedDict[ConstraintSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def cached(self, spec: ConstraintSpec) -> xgr.CompiledGrammar | None:
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
            return hit

    def compile(self, spec: ConstraintSpec, budget: Budget | None = None) -> xgr.CompiledGrammar:
        """The compiled grammar; ConstraintError when invalid, CompileTimeout past the budget
        (the request's, else `DEFAULT_COMPILE_TIMEOUT_S`)."""
        hit = self.cached(spec)
        if hit is not None:
            return hit
        budget = budget or Budget(DEFAULT_COMPILE_TIMEOUT_S)
        compiled = self.pool.compile(spec, budget)
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: ConstraintSpec) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self.compile(spec))

    def __len__(self) -> int:
        return len(self._compiled)
