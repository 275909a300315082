"""The `mlxmtp` command line, the top layer: one module per command (main.py holds the
group), each parsing its options, building the config objects the layers below take
(engine.config.EngineConfig, server.config.ServerConfig) and calling into them."""
