"""Client tools: call, eval, replay."""

from __future__ import annotations

import argparse


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, except where there is none (None, or an off flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)
