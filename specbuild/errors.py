"""The one error type users see: a one-line message naming the file, tensor or value at fault."""


class SpecbuildError(Exception):
    """A user-facing failure. The CLI prints `error: <message>` on one line and exits with code 1."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
