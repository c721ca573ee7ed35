# Ported from MoRI-IO (ROCm/mori, tests/python/io/test_engine.py); only the imports differ: these are its tests that need no GPU, copied whole (the others need torch on GPUs).
# The original's notice follows.
#
# Copyright © Advanced Micro Devices, Inc. All rights reserved.
#
# MIT License
#
# Permission is hereby granted, free of charge, to any person obtaining a copy
# of this software and associated documentation files (the "Software"), to deal
# in the Software without restriction, including without limitation the rights
# to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
# copies of the Software, and to permit persons to whom the Software is
# furnished to do so, subject to the following conditions:
#
# The above copyright notice and this permission notice shall be included in all
# copies or substantial portions of the Software.
#
# THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
# IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
# FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
# AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
# LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
# OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
# SOFTWARE.
from moriio_async.compat.mori import (
    IOEngineConfig,
    BackendType,
    IOEngine,
    EngineDesc,
    RdmaBackendConfig,
)


def test_engine_desc():
    config = IOEngineConfig(
        host="127.0.0.1",
        port=0,
    )
    engine = IOEngine(key="engine", config=config)
    engine.create_backend(BackendType.RDMA)

    desc = engine.get_engine_desc()
    assert desc.node_id != ""
    assert desc.pid > 0

    packed_desc = desc.pack()
    unpacked_desc = EngineDesc.unpack(packed_desc)
    assert desc == unpacked_desc


def test_engine_desc_port_zero_auto_bind():
    config = IOEngineConfig(
        host="127.0.0.1",
        port=0,
    )
    engine = IOEngine(key="engine_port0", config=config)
    engine.create_backend(BackendType.RDMA)

    desc = engine.get_engine_desc()
    assert desc.port > 0
    assert desc.node_id != ""
    assert desc.pid > 0

    packed_desc = desc.pack()
    unpacked_desc = EngineDesc.unpack(packed_desc)
    assert desc == unpacked_desc


def test_engine_desc_node_id_env_override(monkeypatch):
    monkeypatch.setenv("MORI_NODE_ID", "node-id-test")
    config = IOEngineConfig(
        host="127.0.0.1",
        port=0,
    )
    engine = IOEngine(key="engine_node_id", config=config)
    desc = engine.get_engine_desc()
    assert desc.node_id == "node-id-test"


def test_rdma_backend_config_chunking_fields():
    default_config = RdmaBackendConfig()
    assert default_config.chunk_bytes == 65536

    config = RdmaBackendConfig(
        qp_per_transfer=4,
        post_batch_size=-1,
        num_worker_threads=2,
        enable_notification=True,
        notif_per_qp=2048,
        enable_transfer_chunking=True,
        chunk_bytes=65536,
        max_chunks_per_transfer=32,
        num_nics_per_transfer=2,
    )

    assert config.qp_per_transfer == 4
    assert config.post_batch_size == -1
    assert config.num_worker_threads == 2
    assert config.enable_notification is True
    assert config.notif_per_qp == 2048
    assert config.enable_transfer_chunking is True
    assert config.chunk_bytes == 65536
    assert config.max_chunks_per_transfer == 32
    assert config.num_nics_per_transfer == 2
