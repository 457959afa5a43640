"""Generated from proto/deviceplugin/ by scripts/gen_proto.py. Never edited by hand."""
