"""tmod runtime: backbone streaming, heads, execution plan, engine, HTTP API."""

# the one place tmod's version is written: pyproject.toml reads it, and so do `--version`, GET /v2,
# the schema at /docs, the start-up log and each trained module's manifest
__version__ = "0.1.0"
