// pybind11 bindings of the native drain loop (module mgraph.runtime.proxy.native._drain).
//
// Python keeps the control plane: runtime/proxy/native/__init__.py builds a Drain over a
// CommandFifo's tensors, lets the transport register memory and events on it, and turns errors
// into ProxyErrors. Every call that can block (stop, wait, produce) releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <initializer_list>
#include <thread>
#include <utility>

#include "command.h"
#include "copy_kernel.h"
#include "drain.h"
#include "verbs.h"
#include "wire.h"

namespace py = pybind11;
using namespace mgraph;

namespace {

void add_buffer(Drain& d, int64_t rank, int place, int64_t index, uint64_t ptr, int64_t rows,
                int64_t cols, int64_t row_bytes, int64_t itemsize, const std::string& dtype,
                int device) {
  RankMemory& m = d.mover.rank(rank);
  const Place p = static_cast<Place>(place);
  if (m.place != Place::kNone && m.place != p)
    throw py::value_error("rank " + std::to_string(rank) + " is registered in two places");
  if (rows < 0 || cols < 0 || itemsize <= 0 || row_bytes < cols * itemsize)
    throw py::value_error("buffer " + std::to_string(index) + " of rank " +
                          std::to_string(rank) + ": bad shape or stride");
  m.place = p;
  if (p == Place::kCuda) m.device = device;
  m.buffers[index] = Buffer{reinterpret_cast<uint8_t*>(ptr), rows, cols, row_bytes, itemsize, dtype};
}

// Event words are read and atomically added by the loop: refuse what would fault or tear.
void check_words(int64_t rank, uint64_t ptr, int64_t n, size_t size) {
  if (n < 0 || (n > 0 && ptr == 0) || ptr % size != 0)
    throw py::value_error("event words of rank " + std::to_string(rank) + ": " +
                          std::to_string(n) + " words at address " + std::to_string(ptr) +
                          " (need n >= 0 and a non-null address aligned to " +
                          std::to_string(size) + " bytes)");
}

py::dict region_dict(const NicRegion& r) {
  py::dict d;
  d["addr"] = r.addr;
  d["length"] = r.length;
  d["lkey"] = r.lkey;
  d["rkey"] = r.rkey;
  d["memory"] = nic_memory_name(r.memory);
  return d;
}

py::dict nic_stats(const Nic& n) {
  py::dict d;
  d["post_calls"] = n.stats.post_calls;
  d["wrs"] = n.stats.wrs;
  d["imms"] = n.stats.imms;
  d["signaled"] = n.stats.signaled;
  d["send_completions"] = n.stats.send_completions;
  d["recv_completions"] = n.stats.recv_completions;
  d["staged_copies"] = n.stats.staged_copies;
  d["staged_bytes"] = n.stats.staged_bytes;
  d["stage_waits"] = n.stats.stage_waits;
  d["max_chain"] = n.max_chain;
  return d;
}

// The GPU's side of the FIFO protocol, for tests and benchmarks: claim a ticket with a
// compare-and-swap on head while there is room (tail + capacity), write the body, publish the
// header with a release store. Pushes ``count`` commands cycling through ``bodies`` (16 words
// each; word 0 holds the opcode only). Returns how many were pushed before ``timeout_s``.
int64_t produce(uint64_t ring_ptr, uint64_t head_ptr, uint64_t tail_ptr, int64_t capacity,
                const std::vector<std::vector<int64_t>>& bodies, int64_t count,
                double timeout_s) {
  auto* ring = reinterpret_cast<int64_t*>(ring_ptr);
  auto* head = reinterpret_cast<int64_t*>(head_ptr);
  auto* tail = reinterpret_cast<int64_t*>(tail_ptr);
  const double deadline = now_s() + timeout_s;
  for (int64_t i = 0; i < count; ++i) {
    int64_t ticket = __atomic_load_n(head, __ATOMIC_RELAXED);
    while (true) {
      if (ticket - __atomic_load_n(tail, __ATOMIC_ACQUIRE) < capacity) {
        if (__atomic_compare_exchange_n(head, &ticket, ticket + 1, false, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED))
          break;
        continue;  // another producer took it; ticket now holds the new head
      }
      if (now_s() > deadline) return i;
      std::this_thread::yield();
      ticket = __atomic_load_n(head, __ATOMIC_RELAXED);
    }
    const auto& body = bodies[static_cast<size_t>(i) % bodies.size()];
    int64_t* slot = ring + (ticket & (capacity - 1)) * kWords;
    for (int w = 1; w < kWords; ++w) slot[w] = body[static_cast<size_t>(w)];
    __atomic_store_n(slot, ((ticket + 1) << 8) | (body[0] & 0xff), __ATOMIC_RELEASE);
  }
  return count;
}

}  // namespace

PYBIND11_MODULE(_drain, m) {
  m.doc() = "Native drain loop of the mgraph host proxy (see drain.h)";
  m.attr("WORDS") = kWords;
  auto table = [](std::initializer_list<std::pair<const char*, int64_t>> items) {
    py::dict d;
    for (const auto& [name, value] : items) d[name] = value;
    return d;
  };
  m.attr("WORD_INDEX") = table({{"HEADER", kHeader}, {"TASK", kTask}, {"EPOCH", kEpoch},
                                {"SRC_RANK", kSrcRank}, {"SRC_BUF", kSrcBuf},
                                {"SRC_ROWS", kSrcRows}, {"SRC_COLS", kSrcCols},
                                {"DST_RANK", kDstRank}, {"DST_BUF", kDstBuf},
                                {"DST_ROWS", kDstRows}, {"DST_COLS", kDstCols},
                                {"BYTES", kBytes}, {"EVENT", kEvent},
                                {"DONE_EVENT", kDoneEvent}, {"LANE", kLane}});
  m.attr("OPCODES") =
      table({{"NOP", kNop}, {"WRITE", kWrite}, {"SIGNAL", kSignal}, {"SHUTDOWN", kShutdown}});
  m.attr("FRAME") = table({{"HEADER_WORDS", wire::kHeaderWords}, {"MAGIC", wire::kMagic},
                           {"MAX_EVENTS", wire::kMaxEvents}, {"WRITE", wire::kWrite},
                           {"SIGNAL", wire::kSignal}, {"FENCE", wire::kFence},
                           {"BYE", wire::kBye}});
  m.attr("PLACE_HOST") = int(Place::kHost);
  m.attr("PLACE_CUDA") = int(Place::kCuda);
  m.attr("PLACE_SOCKET") = int(Place::kSocket);
  m.attr("PLACE_VERBS") = int(Place::kVerbs);
  // The copy-and-flag kernel's PTX (tests assemble it with ptxas where one is installed).
  m.attr("COPY_KERNEL_PTX") = std::string(kCopyKernelPtx);
  m.attr("COPY_KERNEL_NAME") = std::string(kCopyKernelName);
  // A Failure thrown while setting up (the NIC's calls) reaches Python as RuntimeError; the
  // Python side turns it into a named error (RdmaUnavailableError or ProxyError).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Failure& f) {
      PyErr_SetString(PyExc_RuntimeError, f.message.c_str());
    }
  });

  py::class_<Nic, std::shared_ptr<Nic>>(m, "Nic", "One RDMA NIC port of the verbs backend "
                                                  "(verbs.h); set up from Python, then handed "
                                                  "to ONE Drain (use_verbs)")
      .def(py::init<>())
      .def("open", &Nic::open, py::arg("libs"), py::arg("device"), py::arg("port"),
           py::arg("gid_index"), py::arg("depth"), py::arg("max_peers"))
      .def("use_cuda", &Nic::use_cuda, py::arg("runtime_libs"), py::arg("driver_libs"))
      .def("register_host", [](Nic& n, uint64_t addr, uint64_t bytes) {
        return region_dict(n.register_host(addr, bytes));
      })
      .def("register_gpu", [](Nic& n, uint64_t addr, uint64_t bytes, const std::string& mode) {
        return region_dict(n.register_gpu(addr, bytes, mode));
      })
      .def("create_qp", [](Nic& n, int64_t local, int64_t peer) {
        const QpAddress a = n.create_qp(local, peer);
        py::dict d;
        d["qp_num"] = a.qp_num;
        d["psn"] = a.psn;
        d["lid"] = a.lid;
        d["gid"] = py::bytes(a.gid);
        return d;
      })
      .def("connect", [](Nic& n, int64_t local, int64_t peer, uint32_t qp_num, uint32_t psn,
                         uint16_t lid, const py::bytes& gid) {
        n.connect(local, peer, QpAddress{qp_num, psn, lid, std::string(gid)});
      }, py::arg("local"), py::arg("peer"), py::arg("qp_num"), py::arg("psn"), py::arg("lid"),
         py::arg("gid"))
      .def("connected", &Nic::connected)
      .def_property_readonly("device", &Nic::device_name)
      .def_property("staging_bytes", [](const Nic& n) { return n.staging_bytes; },
                    [](Nic& n, uint64_t v) {
                      if (v < 4096) throw py::value_error("staging_bytes must be >= 4096");
                      n.staging_bytes = v;
                    })
      .def("stats", &nic_stats);

  m.def("atomic_add", [](uint64_t address, int64_t delta) {
    return __atomic_add_fetch(reinterpret_cast<int64_t*>(address), delta, __ATOMIC_ACQ_REL);
  }, "Atomically add ``delta`` to the int64 at ``address``; returns the new value.");
  m.def("atomic_load", [](uint64_t address) {
    return __atomic_load_n(reinterpret_cast<int64_t*>(address), __ATOMIC_ACQUIRE);
  });
  m.def("produce", &produce, py::call_guard<py::gil_scoped_release>(), py::arg("ring"),
        py::arg("head"), py::arg("tail"), py::arg("capacity"), py::arg("bodies"),
        py::arg("count"), py::arg("timeout_s") = 10.0);

  py::class_<Drain>(m, "Drain")
      .def(py::init<uint64_t, uint64_t, uint64_t, int64_t, int, bool, double>(), py::arg("ring"),
           py::arg("head"), py::arg("tail"), py::arg("capacity"), py::arg("batch"),
           py::arg("coalesce"), py::arg("timeout_s"))
      .def("add_buffer", &add_buffer, py::arg("rank"), py::arg("place"), py::arg("index"),
           py::arg("ptr"), py::arg("rows"), py::arg("cols"), py::arg("row_bytes"),
           py::arg("itemsize"), py::arg("dtype"), py::arg("device") = -1)
      .def("set_host_events", [](Drain& d, int64_t rank, uint64_t ptr, int64_t n) {
        check_words(rank, ptr, n, sizeof(int64_t));
        RankMemory& r = d.mover.rank(rank);
        r.counters = reinterpret_cast<int64_t*>(ptr);
        r.host_flags = nullptr;
        r.n_events = n;
      })
      .def("set_host_flags", [](Drain& d, int64_t rank, uint64_t ptr, int64_t n) {
        check_words(rank, ptr, n, sizeof(int32_t));
        RankMemory& r = d.mover.rank(rank);
        r.host_flags = reinterpret_cast<int32_t*>(ptr);
        r.counters = nullptr;
        r.n_events = n;
      }, py::arg("rank"), py::arg("ptr"), py::arg("n"),
      "``rank``'s events are the ``n`` int32 words at ``ptr`` (host memory, e.g. a Triton-"
      "interpreted megakernel's flags): raising event e by k is an atomic release add of k.")
      .def("set_cuda_flags", [](Drain& d, int64_t rank, uint64_t flags, int64_t n, uint64_t shadow) {
        RankMemory& r = d.mover.rank(rank);
        r.flags = flags;
        r.shadow = reinterpret_cast<int64_t*>(shadow);
        r.n_events = n;
      })
      .def("set_cuda_host_flags", [](Drain& d, int64_t rank, uint64_t ptr, int64_t n) {
        // A GPU rank whose int32 flag words are pinned host memory (mover.h, "Host-resident
        // flags"): the loop raises them with host stores once the stream is past their data.
        check_words(rank, ptr, n, sizeof(int32_t));
        if (d.started()) throw py::value_error("set_cuda_host_flags after the loop started");
        RankMemory& r = d.mover.rank(rank);
        r.host_flags = reinterpret_cast<int32_t*>(ptr);
        r.flags = 0;
        r.shadow = nullptr;
        r.n_events = n;
      })
      .def("set_socket", [](Drain& d, int64_t rank, int fd, int64_t n_events) {
        RankMemory& r = d.mover.rank(rank);
        r.place = Place::kSocket;
        r.fd = fd;
        r.n_events = n_events;
      })
      .def("use_cuda", [](Drain& d, int device, const std::vector<std::string>& runtime_libs,
                          const std::vector<std::string>& driver_libs) {
        const std::string err = d.mover.cuda.load(runtime_libs, driver_libs);
        if (!err.empty()) return err;
        d.mover.cuda_device = device;
        return std::string();
      })
      .def("use_verbs", [](Drain& d, std::shared_ptr<Nic> nic) {
        if (d.started()) throw py::value_error("use_verbs after the loop started");
        if (d.mover.n_streams > 1)
          throw py::value_error("the verbs backend raises GPU flags from one stream: streams "
                                "must be 1 with it (Settings.proxy_streams)");
        nic->abort = d.mover.abort;
        nic->timeout_s = d.mover.send_timeout_s;
        d.mover.nic = std::move(nic);
      })
      .def("add_remote_buffer", [](Drain& d, int64_t rank, int64_t index, uint64_t addr,
                                   uint32_t rkey, int64_t rows, int64_t cols, int64_t row_bytes,
                                   int64_t itemsize, const std::string& dtype, bool writable) {
        RankMemory& m = d.mover.rank(rank);
        if (m.place != Place::kNone && m.place != Place::kVerbs)
          throw py::value_error("rank " + std::to_string(rank) + " is registered in two places");
        if (rows < 0 || cols < 0 || itemsize <= 0 || row_bytes < cols * itemsize)
          throw py::value_error("remote buffer " + std::to_string(index) + " of rank " +
                                std::to_string(rank) + ": bad shape or stride");
        m.place = Place::kVerbs;
        Buffer b{reinterpret_cast<uint8_t*>(addr), rows, cols, row_bytes, itemsize, dtype};
        b.rkey = rkey;
        b.writable = writable;
        m.buffers[index] = b;
      }, py::arg("rank"), py::arg("index"), py::arg("addr"), py::arg("rkey"), py::arg("rows"),
         py::arg("cols"), py::arg("row_bytes"), py::arg("itemsize"), py::arg("dtype"),
         py::arg("writable"))
      .def("set_remote_events", [](Drain& d, int64_t rank, int64_t n) {
        d.mover.rank(rank).n_events = n;  // bounds the event ids sent to it
      })
      .def_property("bytes_per_s", [](const Drain& d) { return d.mover.bytes_per_s; },
                    [](Drain& d, double v) { d.mover.bytes_per_s = v; })
      .def_property("flag_copy", [](const Drain& d) { return d.mover.flag_copy; },
                    [](Drain& d, bool v) {
                      // the loop allocates the staging ring when it starts
                      if (d.started())
                        throw py::value_error("flag_copy is fixed once the loop has started");
                      d.mover.flag_copy = v;
                    })
      .def_property("streams", [](const Drain& d) { return d.mover.n_streams; },
                    [](Drain& d, int n) {
                      // the loop creates its streams when it starts
                      if (d.started())
                        throw py::value_error("streams is fixed once the loop has started");
                      if (n > 1 && d.mover.nic != nullptr)
                        throw py::value_error("streams must be 1 with the verbs backend");
                      if (n < 1 || n > 64)
                        throw py::value_error("streams must be in [1, 64], got " +
                                              std::to_string(n));
                      d.mover.n_streams = n;
                    })
      .def_property("allow_batch", [](const Drain& d) { return d.mover.allow_batch; },
                    [](Drain& d, bool v) {
                      if (d.started())
                        throw py::value_error("allow_batch is fixed once the loop has started");
                      d.mover.allow_batch = v;
                    })
      .def_property("fuse_flags", [](const Drain& d) { return d.mover.fuse_flags; },
                    [](Drain& d, bool v) {
                      // the loop allocates the one-stream staging ring by it when it starts
                      if (d.started())
                        throw py::value_error("fuse_flags is fixed once the loop has started");
                      d.mover.fuse_flags = v;
                    })
      .def_property("driver_copy", [](const Drain& d) { return d.mover.driver_copy; },
                    [](Drain& d, bool v) {
                      if (d.started())
                        throw py::value_error("driver_copy is fixed once the loop has started");
                      d.mover.driver_copy = v;
                    })
      .def_property("gpu_fence", [](const Drain& d) { return d.mover.gpu_fence; },
                    [](Drain& d, bool v) {
                      if (d.started())
                        throw py::value_error("gpu_fence is fixed once the loop has started");
                      d.mover.gpu_fence = v;
                    })
      .def_property("copy_kernel_bytes", [](const Drain& d) { return d.mover.copy_kernel_bytes; },
                    [](Drain& d, int64_t v) {
                      // the loop loads the kernel when it starts
                      if (d.started())
                        throw py::value_error("copy_kernel_bytes is fixed once the loop has started");
                      if (v < 0)
                        throw py::value_error("copy_kernel_bytes must be >= 0 (0: off), got " +
                                              std::to_string(v));
                      d.mover.copy_kernel_bytes = v;
                    })
      .def_property_readonly("kernel_api", [](const Drain& d) {
        return d.mover.cuda.has_kernel();
      }, "the driver has what the copy kernel needs (cuModuleLoadData, cuLaunchKernel, ...)")
      .def_property("local_memory", [](const Drain& d) { return d.mover.local_memory; },
                    [](Drain& d, bool v) {
                      if (d.started())
                        throw py::value_error("local_memory is fixed once the loop has started");
                      d.mover.local_memory = v;
                    }, "every buffer and flag word the loop reaches is on the proxy's GPU "
                       "(the transport says so when it attaches)")
      .def_property_readonly("gpu_scope", [](const Drain& d) { return d.mover.gpu_scope(); },
                             "fused memop flags take one GPU-scope barrier per call")
      .def_property_readonly("batch_api", [](const Drain& d) { return d.mover.batch_api(); },
                             "cudaMemcpyBatchAsync will be used (several streams or fused "
                             "flags, a CUDA runtime >= 12.8 that has it, allow_batch)")
      .def_property_readonly("batch_memop", [](const Drain& d) {
        return d.mover.cuda.has_batch_memop();
      }, "the driver has cuStreamBatchMemOp (fused cuStreamWriteValue32 flags use it)")
      .def_property_readonly("driver_copy_api", [](const Drain& d) {
        return d.mover.cuda.has_driver_copy();
      }, "the driver has cuMemcpyAsync (driver_copy uses it)")
      .def_property_readonly("cuda_runtime_version",
                             [](const Drain& d) { return d.mover.cuda.runtime_version(); })
      .def_property("doorbell_fd", [](const Drain& d) { return d.mover.doorbell_fd; },
                    [](Drain& d, int fd) { d.mover.doorbell_fd = fd; })
      .def_property("idle_sleep_us", [](const Drain& d) { return d.idle_sleep_us; },
                    [](Drain& d, int us) {
                      if (us < 0)
                        throw py::value_error("idle_sleep_us must be >= 0 (0: never sleep), got " +
                                              std::to_string(us));
                      d.idle_sleep_us = us;
                    })
      .def("start", &Drain::start)
      .def("stop", &Drain::stop, py::call_guard<py::gil_scoped_release>())
      .def("wait", &Drain::wait, py::call_guard<py::gil_scoped_release>())
      .def("abort", &Drain::abort)
      .def_property_readonly("running", &Drain::running)
      .def("error", [](const Drain& d) -> py::object {
        const DrainError e = d.error();
        if (!e.set) return py::none();
        return py::make_tuple(e.ticket, e.message);
      })
      .def("stats", [](Drain& d) {
        py::dict s;
        s["commands"] = d.commands.load();
        s["batches"] = d.batches.load();
        s["max_batch"] = d.max_batch.load();
        s["coalesced"] = d.coalesced.load();
        s["writes"] = d.mover.stats.writes.load();
        s["signals"] = d.mover.stats.signals.load();
        s["bytes"] = d.mover.stats.bytes.load();
        s["events"] = d.mover.stats.events.load();
        s["raises"] = d.mover.stats.raises.load();
        s["streams"] = d.mover.n_streams;
        s["data_copies"] = d.mover.stats.data_copies.load();
        s["flag_copies"] = d.mover.stats.flag_copies.load();
        s["batch_calls"] = d.mover.stats.batch_calls.load();
        s["busy_ns"] = d.busy_ns.load();
        s["paced_ns"] = d.mover.stats.paced_ns.load();
        s["cuda_call_ns"] = d.mover.cuda.call_ns.load();
        s["cuda_calls"] = d.mover.cuda.calls.load();
        s["flag_calls"] = d.mover.stats.flag_calls.load();
        s["flag_call_ns"] = d.mover.stats.flag_call_ns.load();
        s["kernel_writes"] = d.mover.stats.kernel_writes.load();
        return s;
      })
      .def("sent_to", [](const Drain& d) {
        // Read only after the loop ended: the map belongs to the loop thread.
        py::dict out;
        for (const auto& [rank, sent] : d.mover.sent_to)
          out[py::int_(rank)] = py::make_tuple(sent.first, sent.second);
        return out;
      });
}
