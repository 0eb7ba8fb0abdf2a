"""Configuration: sources, precedence, and the README reference."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aifs.config import load_config, option_fields, parse_size
from aifs.errors import ConfigError

README = Path(__file__).resolve().parents[2] / "README.md"


def test_sizes():
    assert parse_size("8M") == 8 << 20 and parse_size("2GiB") == 2 << 30
    assert parse_size("512") == 512 and parse_size("1.5k") == 1536
    with pytest.raises(ConfigError):
        parse_size("lots")


def test_precedence(tmp_path):
    toml = tmp_path / "a.toml"
    toml.write_text('cache-size = "1G"\nmetadata_ttl = 5\nblock_size = "4M"\n')
    cfg = load_config(str(toml), {"metadata_ttl": 7.0},
                      environ={"AIFS_BLOCK_SIZE": "2M", "AIFS_CACHE_SIZE": "2G"})
    assert cfg.cache_size == 2 << 30  # env beats the file
    assert cfg.block_size == 2 << 20
    assert cfg.metadata_ttl == 7.0  # the command line beats both


def test_unknown_or_bad_options(tmp_path):
    toml = tmp_path / "b.toml"
    toml.write_text("no_such_option = 1\n")
    with pytest.raises(ConfigError, match="unknown option"):
        load_config(str(toml), {}, environ={})
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.toml"), {}, environ={})
    with pytest.raises(ConfigError):
        load_config(None, {"retries": 0}, environ={})


def test_removed_options_are_ignored_with_a_warning(tmp_path, caplog, capsys):
    """A config file, environment, command line or fstab line written for an
    earlier release (fuse_native, fuse_transport) still mounts: each removed
    option is named in a warning and ignored, not refused."""
    from aifs.mount_helper import mount_command
    from aifs.mount_options import mount_arguments, mount_options

    toml = tmp_path / "old.toml"
    toml.write_text('fuse_native = false\nfuse-transport = "uring"\nmetadata_ttl = 9\n')
    cfg = load_config(str(toml), {}, environ={"AIFS_FUSE_NATIVE": "false"})
    assert cfg.metadata_ttl == 9
    warned = [r.getMessage() for r in caplog.records]
    assert sum("was removed" in m for m in warned) == 3, warned

    import argparse
    parser = argparse.ArgumentParser()
    mount_arguments(parser)
    args = parser.parse_args(["/mnt/x", "--fuse-native", "false", "--fuse-transport", "dev"])
    assert (args.removed_fuse_native, args.removed_fuse_transport) == ("false", "dev")
    assert not any("--fuse-native" in strings for strings in mount_options())  # undocumented

    command, env, _ = mount_command(["/var/lib/lake", "/mnt/x", "-o",
                                     "fuse_native=false,fuse_transport,metadata_ttl=3"])
    assert not any("fuse_native" in part or "fuse_transport" in part
                   for part in [*command, *env]), (command, env)
    assert "--metadata-ttl" in command
    assert capsys.readouterr().err.count("was removed") == 2


def test_readme_lists_every_option():
    text = README.read_text()
    table = text.split("## Configuration reference", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", table, re.M))
    assert documented == {f.name for f in option_fields()}


def _mount_options() -> list[list[str]]:
    """The option strings of each ``aifs mount`` option (``["--foreground", "-f"]``)."""
    from aifs.mount_options import mount_options
    return mount_options()


def test_readme_rows_match_the_code_and_the_command_line():
    """Each row's flag, variable and meaning are what the code accepts; every
    flag of ``aifs mount`` is documented."""
    text = README.read_text()
    table = text.split("## Configuration reference", 1)[1].split("\n## ", 1)[0]
    fields = {f.name: f for f in option_fields()}
    options = _mount_options()
    flags = {flag for strings in options for flag in strings}
    documented_flags = set()
    for row in re.findall(r"^\| `[a-z_]+` \|.*$", table, re.M):
        name, cli, env, _default, meaning = [c.strip() for c in row.strip("|").split(" | ")]
        field = fields[name.strip("`")]
        assert meaning == field.metadata["doc"], name
        expected_env = f"AIFS_{field.name.upper()}" if field.metadata["env"] else None
        assert (env.split("`")[1] if "`" in env else None) == expected_env, name
        if "`" in cli:
            flag = cli.split("`")[1].split()[0]
            assert flag in flags, f"{name}: {flag} is not an aifs mount flag"
            documented_flags.add(flag)
        else:
            assert "--" + field.name.replace("_", "-") not in flags, f"{name}: flag undocumented"
    for strings in options:
        if "--help" in strings or documented_flags & set(strings):
            continue
        assert any(f"`{flag}" in text or f" {flag}" in text for flag in strings), \
            f"{strings} not in the README"


def test_large_files_stream_to_s3_lakes_unless_told(tmp_path):
    """``auto`` streams to S3 only: a local-directory lake shares the writer's disk."""
    def streams(lake: str, **overrides) -> bool:
        return load_config(None, {"lake": lake, **overrides}, environ={}).streams_large_files()
    assert streams("s3://bucket/prefix")
    assert not streams(f"file://{tmp_path}")
    assert not streams(str(tmp_path))
    assert streams(str(tmp_path), stream_large_files="true")
    assert streams(str(tmp_path), stream_large_files="yes")
    assert not streams("s3://bucket", stream_large_files="off")
    with pytest.raises(ConfigError, match="stream_large_files"):
        load_config(None, {"stream_large_files": "sometimes"}, environ={})


def test_checkpoints_stream_to_s3_lakes_unless_told(tmp_path):
    """Checkpoints alike: ``auto`` streams them to S3 only."""
    def streams(lake: str, **overrides) -> bool:
        return load_config(None, {"lake": lake, **overrides}, environ={}).streams_checkpoints()
    assert streams("s3://bucket/prefix")
    assert not streams(str(tmp_path))
    assert streams(str(tmp_path), stream_checkpoints="true")
    assert not streams("s3://bucket", stream_checkpoints="false")
    with pytest.raises(ConfigError, match="stream_checkpoints"):
        load_config(None, {"stream_checkpoints": "maybe"}, environ={})
