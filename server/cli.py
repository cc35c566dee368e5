"""`tmod-serve`: start the HTTP server. Flags override TMOD_* environment variables."""
from __future__ import annotations

import argparse
import uvicorn

from server.config import Settings
from server.logs import configure_logging


def parse_args(argv=None) -> dict:
    fields = Settings.model_fields
    parser = argparse.ArgumentParser(
        prog="tmod-serve",
        description="Serve every task module in a store from one frozen backbone pass per batch. "
        "Each flag can also be set as an environment variable TMOD_<NAME> (e.g. TMOD_PORT=9000).",
    )
    parser.add_argument("--host", help=f"{fields['host'].description} (default {fields['host'].default})")
    parser.add_argument("--port", type=int, help=f"{fields['port'].description} (default {fields['port'].default})")
    parser.add_argument("--store", help=f"{fields['store'].description} (default: modules_store/ of this package)")
    parser.add_argument("--backbone", help=fields["backbone"].description)
    parser.add_argument("--device", help=f"{fields['device'].description} (default cpu)")
    parser.add_argument("--tasks", help=fields["tasks"].description)
    parser.add_argument("--threads", type=int, help=fields["threads"].description)
    parser.add_argument("--max-inputs", type=int, help=fields["max_inputs"].description)
    parser.add_argument("--max-chars", type=int, help=fields["max_chars"].description)
    parser.add_argument("--max-tokens", type=int, help=fields["max_tokens"].description)
    parser.add_argument("--max-body-bytes", type=int, help=fields["max_body_bytes"].description)
    parser.add_argument("--log-level", help=fields["log_level"].description)
    args = vars(parser.parse_args(argv))
    return {k: v for k, v in args.items() if v is not None}


def main(argv=None) -> None:
    overrides = parse_args(argv)
    settings = Settings(**overrides)
    configure_logging(settings.log_level)
    from server.app import create_app  # imported late so --help stays fast

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
                log_config=None, access_log=False)  # our JSON lines replace uvicorn's access log


if __name__ == "__main__":
    main()
