"""Default limits of a server, apart from the modules that apply them so the CLI's flags can show
them without importing the web stack."""

MAX_REQUEST_BYTES = 4 << 20
READ_TIMEOUT = 30.0
SHUTDOWN_TIMEOUT = 30.0
MEDIA_FETCH_TIMEOUT = 10.0
