"""Generated from proto/pluginregistration/ by scripts/gen_proto.py. Never edited by hand."""
