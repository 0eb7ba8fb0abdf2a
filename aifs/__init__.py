"""aifs: a FUSE filesystem that presents an object-store data lake as POSIX."""

__version__ = "0.1.0"
