"""The virtual clock (issue 51): device profiles and availability traces, the time a client's
work takes, synchronous rounds under deadlines / over-selection / dropouts, and FedBuff.

Entry from the round loop: ``fedsub.clock.hooks.clocked``; settings: ``[clock]``
(``fedsub.clock.settings``); docs: docs/how-to/virtual-clock.md."""
