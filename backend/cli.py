"""The `yatt` command line. Each group lives beside the code it drives; this file only wires them.

Heavy modules (torch, ray, streamlit) are imported inside the commands, so `yatt --help` is fast.
"""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="yatt: managed RLHF training.")


def _register() -> None:
    # Each module exposes `register(app)` and imports its heavy dependencies lazily.
    from backend import cli_service, local_stack
    from backend.dispatch import cli as dispatch_cli
    from dashboard import cli as dashboard_cli
    from trainer import cli as trainer_cli
    from trainer.placement import cli as placement_cli

    for module in (cli_service, dispatch_cli, local_stack, trainer_cli, dashboard_cli, placement_cli):
        module.register(app)


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
