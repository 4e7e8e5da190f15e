"""The neutral bottom layer every role may import: state machines, config schemas, log formats, traces."""
