"""The one base of the errors a user can fix (a config field, a data file, a checkpoint, a workdir): the CLI prints
such an error as one `error:` line and exits with its `exit_code`, never with a traceback."""

from __future__ import annotations


class UserError(Exception):
    """An error whose message names what to fix; every such class of the package derives from this one."""
    exit_code = 2


class ConfigValidationError(UserError, ValueError):
    """A config that cannot run; the message names the field."""
