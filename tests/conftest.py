"""Suite-wide collection hooks (fixtures live beside the tests that use them)."""

from collections import Counter

try:  # pytest 9
    from _pytest.nodes import NodeId
except ImportError:  # pytest 8: a node id is its string
    NodeId = None

# The files that take longest (measured with --durations; the slow test_notebook and test_hostile_fuzz placed
# by estimate; a file is one unit of work for pytest-xdist's --dist loadfile): handed out first, so that the
# two workers of `make test` do not each end on a long file begun late.  By default xdist orders files by their number of tests, which put these last; the
# Makefile turns that off (--no-loadscope-reorder) and the order below is the one it follows.
LONGEST_FIRST = ("test_plugin_training.py", "test_readme.py", "test_notebook.py", "test_client_oracle_ep.py",
                 "test_client_oracle.py", "test_hostile_fuzz.py",
                 "test_service_replicas.py", "test_ep_learned.py", "test_certificates.py",
                 "test_replay_bit_identical.py", "test_ep_graph.py", "test_service_serve.py")


def pytest_collection_modifyitems(items):
    """Every item gets a node id of its own.  Schemathesis' ``schema.parametrize()`` makes one item per API
    operation (``test_x[GET /health]``, ...) under the node id of the test function; pytest-xdist (``make test``)
    schedules by node id and would run only one of them.  Then the longest files first, the others by
    their number of tests (xdist's own default order); a file's tests keep their order."""
    for item in items:
        if not item.nodeid.endswith("::" + item.name):
            own = f"{item.parent.nodeid}::{item.name}"
            if NodeId is not None and hasattr(item, "_id"):
                # pytest 9 keeps a structured NodeId (setting _nodeid, pytest 8's, changed nothing: CI ran one API
                # operation of the 13 of each Schemathesis test — found in the forty-third session)
                item._id = NodeId.parse(own)
            else:
                item._nodeid = own
    counts = Counter(item.path.name for item in items)

    def key(item):
        name = item.path.name
        return (0, LONGEST_FIRST.index(name)) if name in LONGEST_FIRST else (1, -counts[name])

    items.sort(key=key)  # stable: a file's tests stay together and in order
