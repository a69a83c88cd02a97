"""`duplexbus eval`: measure a duplex deployment over a corpus of clips (docs/eval.md).

`core` is pure (stages, drain decision, retry rules, figures), `protocols` translates
generate-ws and realtime messages, `runner` does the sockets, `report` the outputs.
"""
