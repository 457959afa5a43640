"""Generated from proto/simkubelet/ by scripts/gen_proto.py. Never edited by hand."""
