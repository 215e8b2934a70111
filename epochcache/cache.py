"""The public :class:`Cache`: the sample store plus the per-epoch torch Datasets and loaders.

The store layer (:class:`epochcache.store.SampleStore`) knows nothing of torch; this facade
adds :meth:`Cache.dataset`, :meth:`Cache.epochs` and :meth:`Cache.stream` on top of it,
importing the data layer only when they are called, so ``import epochcache`` and sampler
processes stay free of torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .store import SampleStore

if TYPE_CHECKING:
    from .data.dataset import EpochDataset
    from .data.stream import CacheStream


class Cache(SampleStore):
    """A local sample cache bounded by ``capacity`` bytes, evicting oldest samples first.

    Takes the arguments of :class:`~epochcache.store.SampleStore` (path, capacity, headroom,
    compression, sync, ...), and adds the training side.
    """

    def dataset(self, epoch: int = 0, **kwargs: Any) -> EpochDataset:
        """A map-style Dataset over a fresh snapshot (see :class:`epochcache.EpochDataset`)."""
        from .data.dataset import EpochDataset

        return EpochDataset.from_cache(self, epoch=epoch, **kwargs)

    def stream(self, **kwargs: Any) -> CacheStream:
        """A torch IterableDataset taking a fresh snapshot per epoch (see
        :class:`epochcache.data.stream.CacheStream`), for your own DataLoader."""
        from .data.stream import CacheStream

        return CacheStream(self, **kwargs)

    def epochs(self, num_epochs: int, **kwargs: Any) -> Any:
        """Yield ``(epoch, loader)``; see :func:`epochcache.data.epochs.epochs`."""
        from .data.epochs import epochs

        return epochs(self, num_epochs, **kwargs)
