"""Constraint specs -> compiled grammars (cached) -> one matcher per sequence.

Compiling a JSON schema against a 49k-token vocabulary takes milliseconds (see the engine
README); the cache keys compiled grammars by their spec, least recently used out first, so
a client that sends the same schema with every request compiles it once. Compilation runs
where the request is admitted, so a bad schema or regex is a 400 before the engine sees it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import xgrammar as xgr

from servefleet.engine.structured.constraint import ConstraintError, ConstraintSpec
from servefleet.engine.structured.vocabulary import xgrammar_tokenizer_info
from servefleet.text.tokenizer import Tokenizer

# JSON as compact as json.dumps writes it: a small model given free whitespace may spend
# its whole budget on newlines inside an object.
_SEPARATORS = (", ", ": ")


class GrammarCache:
    def __init__(self, tokenizer: Tokenizer, max_entries: int = 256) -> None:
        self.compiler = xgr.GrammarCompiler(
            xgrammar_tokenizer_info(tokenizer), max_threads=1, cache_enabled=False
        )
        self.max_entries = max_entries
        self._compiled: OrderedDict[ConstraintSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: ConstraintSpec) -> xgr.CompiledGrammar:
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: ConstraintSpec) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self.compile(spec))

    def __len__(self) -> int:
        return len(self._compiled)

    def _compile(self, spec: ConstraintSpec) -> xgr.CompiledGrammar:
        try:
            return self._compile_kind(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            what = {"json_schema": "JSON schema", "regex": "regex", "grammar": "grammar"}
            raise ConstraintError(
                f"invalid {what.get(spec.kind, spec.kind)}: {str(exc).strip()[:500]}", spec.param
            ) from exc

    def _compile_kind(self, spec: ConstraintSpec) -> xgr.CompiledGrammar:
        if spec.kind == "json_object":
            return self.compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=False, separators=_SEPARATORS
            )
        if spec.kind == "json_schema":
            json.loads(spec.value)  # a clear error for text that is not JSON at all
            return self.compiler.compile_json_schema(
                spec.value, any_whitespace=False, separators=_SEPARATORS, strict_mode=True
            )
        if spec.kind == "regex":
            return self.compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            choices = json.loads(spec.value)
            rule = " | ".join(json.dumps(c) for c in choices)
            return self.compiler.compile_grammar(f"root ::= {rule}")
        return self.compiler.compile_grammar(spec.value)
