"""Generated from proto/drahealth/ by scripts/gen_proto.py. Never edited by hand."""
