"""Many nodes on one machine: network namespaces joined by shaped links (netns.py), the links and
the cluster presets they emulate (links.py), the delay line where the kernel has no netem
(relay.py), and the guard that removes a testbed whose owner was killed (guard.py)."""
