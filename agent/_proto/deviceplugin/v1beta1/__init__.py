"""Generated from proto/deviceplugin/v1beta1/ by scripts/gen_proto.py. Never edited by hand."""
