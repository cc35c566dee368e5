"""The argument parser of tmod's commands (tmod-serve, tmod-train and its subcommands).

argparse answers a mistyped flag with the whole usage (34 lines for tmod-serve, 47 for
`tmod-train layermix`) above the one line that says what was wrong. Here a mistake is that one
line, with the flag that was likely meant and where the flags are listed."""
from __future__ import annotations

import argparse


class CommandLineParser(argparse.ArgumentParser):
    def parse_known_args(self, args=None, namespace=None):
        # each parser refuses what it does not know itself, so a subcommand's typo is said by the
        # subcommand (its prog, its flags) rather than passed up to tmod-train as a stray argument
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            from server.errors import did_you_mean  # here: --help stays fast (errors imports FastAPI)

            flags = [flag.split("=")[0] for flag in extras if flag.startswith("--")]
            known = [flag for flag in self._option_string_actions if flag.startswith("--")]
            self.error(f"unrecognized arguments: {' '.join(extras)}{did_you_mean(flags, known)}")
        return namespace, extras

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")
