"""The exceptions kvtool raises on purpose.

Every error a user can cause (bad input, a missing library, corrupt data) is a
``KvtoolError``; the CLI prints its message as one line and exits with its
``exit_code``. Anything else escaping is a bug. The exit codes:

    0    success
    1    the request could not be done (no such entry, not stored, out of memory)
    2    usage: a bad option, argument, spec or input path
    3    unavailable: a library is missing here, or a store server cannot be reached
    4    input that does not decode: corrupt, truncated, not this format, or over a size limit
         (the caller's, or the memory there is to decode it into)
    130  interrupted (Ctrl-C); 143 terminated (SIGTERM); partly written files are removed
"""


class KvtoolError(Exception):
    """Base of every deliberate kvtool error."""

    exit_code = 1


class MissingStoreError(KvtoolError):
    """A store that was to be opened as it is, and is not there (``open_store(..., create=False)``)."""


class UsageError(KvtoolError, ValueError):
    """The caller asked for something that cannot be done (bad spec, bad option).

    Also a ``ValueError``: a host that loads kvtool by its configuration (vLLM's tier
    factory, LMCache's adapter config) reports a ``ValueError`` as the user's mistake."""

    exit_code = 2


class UnknownIdError(UsageError):
    """A codec, layout or store id that no registry knows."""


class DuplicateIdError(KvtoolError):
    """Two registrations claim the same id, so the id is ambiguous."""


class UnavailableError(KvtoolError):
    """A registered component whose library or package is missing here."""

    exit_code = 3


class StoreUnreachableError(UnavailableError):
    """A store's server does not answer, for a command that must not mistake that for an empty store."""


class DecodeError(KvtoolError):
    """Input that does not decode: truncated, corrupted, or not this format."""

    exit_code = 4


class OutputTooLargeError(DecodeError):
    """Decoding would produce more bytes than the caller allowed."""
