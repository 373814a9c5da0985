"""protos: every cross-process contract as a .proto file, one file per receiving service, plus the
generated Python stubs. Filled by the disaggregated-serving issue."""
