"""entrypoint: the HTTP front (deepseek-recipe), the token-level gRPC API, the P/D handshake,
streaming and abort. Filled by the disaggregated-serving and HTTP API issues."""
