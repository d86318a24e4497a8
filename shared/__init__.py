"""pdserve's torch-free core: messages, subjects, bus, KV store, config, logging, errors, metrics."""
