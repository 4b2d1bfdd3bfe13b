"""Code the tests share: starting real nodes and clusters, the fake model hub, the
in-process engine."""
