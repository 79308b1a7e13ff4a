"""SCAFFOLD's control variates (Karimireddy et al. 2020, option II).

The server keeps ``c`` (full model shape); client i keeps ``c_i`` over the rows it trains (the
index's S(i): every row for ``scaffold``, which trains the whole model on each client
(``SubmodelIndex.whole_model``); its own rows for fedsub's ``scaffold-submodel``) and the dense
parameters. During local work client i adds ``c - c_i`` to each gradient; after I steps with
learning rate ``lr_i`` and model change ``delta_i``::

    c_i+ = c_i - c - delta_i / (I * lr_i)      c = c + (1/N) * sum_{i in round} (c_i+ - c_i)

(1/N over all N clients, also when K < N take part.) Per round O(sum of |S(i)|); memory
O(model) on the server plus |S(i)| rows per client that took part: N x M floats for the
whole-model form.
"""

from __future__ import annotations

import numpy as np
import torch

from fedsub.algorithms.sampling import Cohort
from fedsub.client.work import CohortTensors, CohortWork
from fedsub.data.torch_ragged import TorchRagged
from fedsub.numerics import segment_sum
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import CohortUpdate, Updates


class ControlVariates:
    def __init__(self, global_params: Params, index: SubmodelIndex, num_clients: int) -> None:
        self.c = Params(
            {t: torch.zeros_like(v) for t, v in global_params.tables.items()},
            {n: torch.zeros_like(v) for n, v in global_params.dense.items()},
        )
        self.index = index
        self.num_clients = num_clients
        self.device = global_params.device
        self.rows = {t: TorchRagged.of(index.rows[t], self.device) for t in global_params.tables}
        self.client_c: dict[int, Params] = {}

    def _client(self, client: int) -> Params:
        if client not in self.client_c:
            self.client_c[client] = Params(
                {
                    t: v.new_zeros(len(self.index.client_rows(t, client)), v.shape[1])
                    for t, v in self.c.tables.items()
                },
                {n: torch.zeros_like(v) for n, v in self.c.dense.items()},
            )
        return self.client_c[client]

    def corrections(self, cohort: Cohort) -> CohortTensors:
        """``c - c_i`` for every member, in the cohort layout."""
        members = [self._client(int(k)) for k in cohort.clients]
        clients = torch.from_numpy(cohort.clients).to(self.device)
        row_offsets, tables = {}, {}
        for t, table in self.c.tables.items():
            rows = self.rows[t].take(clients)
            row_offsets[t] = rows.offsets.cpu().numpy()  # K + 1 ints, read on the host
            local = torch.cat([m.tables[t] for m in members])
            tables[t] = table.index_select(0, rows.values) - local
        dense = {
            n: v.unsqueeze(0) - torch.stack([m.dense[n] for m in members])
            for n, v in self.c.dense.items()
        }
        return CohortTensors(row_offsets, tables, dense)

    def update(self, update: Updates, work: CohortWork, local_steps: int) -> None:
        """Fold a finished round into c_i and c (``work`` is the round's, corrections included;
        ``c`` may change here because the corrections already hold its old value). The round's
        update is the members' whole ``CohortUpdate`` (SCAFFOLD reads each member's rows)."""
        if not isinstance(update, CohortUpdate):
            raise TypeError(
                f"SCAFFOLD's control variates need the members' CohortUpdate, got "
                f"{type(update).__name__}"
            )
        if work.corrections is None:
            raise ValueError("SCAFFOLD needs the round's corrections to update its variates")
        lr = torch.from_numpy(np.asarray(work.lr, dtype=np.float64))
        share = 1.0 / self.num_clients
        for j, client in enumerate(update.clients.tolist()):
            own = self._client(client)
            c_here = work.corrections.member(j)  # c - c_i, so c = c_here + c_i
            scale = 1.0 / (local_steps * float(lr[j]))
            for t, rows in update.rows.items():
                span = update.member_rows(t, j)
                c_rows = c_here.tables[t] + own.tables[t]
                change = -c_rows - update.table_deltas[t][span] * scale
                own.tables[t] += change
                segment_sum.index_add_(self.c.tables[t], rows[span], share * change)
            for n in self.c.dense:
                c_dense = c_here.dense[n] + own.dense[n]
                change = -c_dense - update.dense_deltas[n][j] * scale
                own.dense[n] += change
                self.c.dense[n] += share * change

    def state_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {f"c.{name}": v for name, v in self.c.state_dict().items()}
        for client, variates in self.client_c.items():
            tensors.update({f"client.{client}.{n}": v for n, v in variates.state_dict().items()})
        return tensors

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore ``c`` and every ``c_i``, in the model's parameter order: the local rule
        pairs corrections with parameters by position, and a safetensors file lists its
        tensors sorted by name, not in that order."""
        self.c = self._in_model_order(
            {n[2:]: v.clone() for n, v in tensors.items() if n.startswith("c.")}
        )
        grouped: dict[int, dict[str, torch.Tensor]] = {}
        for name, value in tensors.items():
            if name.startswith("client."):
                _, client, rest = name.split(".", 2)
                grouped.setdefault(int(client), {})[rest] = value.clone()
        self.client_c = {k: self._in_model_order(v) for k, v in grouped.items()}

    def _in_model_order(self, flat: dict[str, torch.Tensor]) -> Params:
        return Params(
            {t: flat[f"table.{t}"] for t in self.c.tables},
            {n: flat[f"dense.{n}"] for n in self.c.dense},
        )
