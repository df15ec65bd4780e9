"""The `yatt` command line. Each group lives beside the code it drives; this file only wires them.

Heavy modules (torch, ray, streamlit) are imported inside the commands, so `yatt --help` is fast.
"""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="yatt: managed RLHF training.")


def _register() -> None:
    # Each module exposes `register(app)`; a module that is not written yet is simply absent.
    import importlib

    for name in (
        "backend.cli_service",  # api, db, token, submit, runs, metrics, logs
        "backend.dispatch.cli",  # worker, up
        "trainer.cli",  # train, make-tiny-model
        "dashboard.cli",  # dashboard
    ):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue
            raise
        module.register(app)


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
