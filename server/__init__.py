"""tmod runtime: backbone streaming, heads, execution plan, engine, HTTP API."""
