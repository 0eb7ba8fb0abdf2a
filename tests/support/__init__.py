"""Helpers and fixtures the tests share (tests/conftest.py registers the fixture
modules as plugins): servers.py (moto, Ceph RGW), lakes.py (Lake and views of
a lake's objects), packed.py (its packed files, read as docs/packing.md
describes them), mounts.py (aifs mounts in subprocesses, wait_for, tmpfs),
faultproxy.py (faults at the TCP level) and meta.py (a metadata store's records)."""
