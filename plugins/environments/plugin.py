"""Registers the built-in environments."""

from tempering.hookspecs import hookimpl

_E = "tempering.plugins.environments"


@hookimpl
def register_environments(register):
    register(
        "calculator",
        f"{_E}.calculator:Calculator",
        description="products of two numbers via a mul tool, over two turns (the tool_use demo)",
    )
    register(
        "search",
        f"{_E}.search:Search",
        description="multi-hop search over a corpus: search (BM25), open, prune; answer citing [d12] documents",
    )
    register(
        "retry",
        f"{_E}.retry:Retry",
        description="answer, a slow checker (latency_s) says pass or try again, up to `attempts` answers",
    )
    register(
        "openenv",
        f"{_E}.openenv:OpenEnv",
        description="an OpenEnv server's environment (openenv-core 0.3): its action as a tool or the turn's text",
    )
