"""Errors that are the user's mistake, not a bug here.

A `UserError` is raised for something the user gave us: a config value, a path, a data file, a
model directory. Its message names the field / file / line and, where it helps, what to do.
`launch/` prints it as one line, `error: <message>`, and exits with status 1, without a
traceback; every other exception is a bug of ours and keeps its traceback.

Subclass it together with the builtin the error would be anyway, so that callers catching the
builtin keep working: `class TaskBankError(UserError, ValueError)`.
"""


class UserError(Exception):
  """The user's mistake: config, paths, data, model directory — printed as one line."""


class PathNotFoundError(UserError, FileNotFoundError):
  """A path the user named does not exist, or lacks the files it should hold."""
