"""Help text that always shows each option's default, in every subcommand."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, except where the help already explains the default
    (`default: $KUBECONFIG, in-cluster, ~/.kube/config` says more than `(default: None)`)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower():
            return text
        return super()._get_help_string(action)


def fill_missing_help(parser: argparse.ArgumentParser) -> None:
    """Give options without help a line with their default (argparse hides those otherwise),
    in this parser and its sub-parsers, which also get the defaults formatter."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                child.formatter_class = parser.formatter_class
                fill_missing_help(child)
        elif action.option_strings and action.help is None:
            action.help = "default: %(default)s"
