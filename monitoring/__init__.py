"""memtrain's monitoring: metric definitions, memory readers, sinks, dashboards and alert rules.

Never imports ``trainer``. The metrics contract and exporters arrive with issue #5.
"""
