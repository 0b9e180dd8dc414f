"""``craft-rag demo --server URL [--server URL ...]``: the URLs (repeated or comma-separated)
and the systems over several servers (no_cache plus routing policies), checked before any
engine starts. The demo's run over real servers is the shell step of docs/deployment.md."""

from __future__ import annotations

import argparse

import pytest

from craft_rag_bench.demo import ROUTED_DEFAULT, SYSTEMS, add_demo_parser, server_urls, system_names


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_demo_parser(parser.add_subparsers())
    return parser.parse_args(["demo", *argv])


def test_server_repeated_or_comma_separated() -> None:
    repeated = parse("--server", "http://a:1", "--server", "http://b:2")
    assert server_urls(repeated.server) == ["http://a:1", "http://b:2"]
    joined = parse("--server", "http://a:1, http://b:2")
    assert server_urls(joined.server) == ["http://a:1", "http://b:2"]
    assert server_urls(parse().server) == []
    assert server_urls(parse("--server", "http://a:1").server) == ["http://a:1"]


def test_an_empty_server_item_names_the_form_without_credentials() -> None:
    with pytest.raises(ValueError, match=r"--server URL \[--server URL") as err:
        server_urls(["http://u:secret@a:1,"])
    assert "secret" not in str(err.value)


def test_systems_are_routing_policies_over_several_servers() -> None:
    assert system_names(None, several=False) == [s.name for s in SYSTEMS]
    assert system_names(None, several=True) == list(ROUTED_DEFAULT)
    assert system_names("no_cache,least_loaded", several=True) == ["no_cache", "least_loaded"]
    with pytest.raises(ValueError, match=r"craft_tree.*routing policies"):
        system_names("craft_tree", several=True)
    with pytest.raises(ValueError, match="craft_joint"):
        system_names("craft_joint", several=False)
