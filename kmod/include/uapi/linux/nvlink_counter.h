/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
/*
 * nvlink_counter: high-rate sampling of per-link interconnect counters.
 *
 * The misc device /dev/nvlink_stats samples every configured link from an hrtimer and keeps,
 * per open file, what a user-space poll at 0.1-30 s cannot see: per-sample maxima, log2
 * histograms of per-sample utilisation and stall rate, samples over thresholds.
 *
 * This header is the only definition of the ABI: the module includes it and the Python
 * binding (nodescope.kmod_abi) generates its declarations from this text. Keep every
 * constant a plain decimal or hex literal and every type __u32/__u64, naturally aligned.
 *
 * read() at file offset 0 takes a fresh snapshot: one struct nvlc_header followed by
 * header.record_count records of header.record_size bytes. Readers must step by the sizes in
 * the header, not by sizeof() of their own structs, so that old readers skip new tails.
 * Reads at offsets > 0 continue the snapshot taken at offset 0; the end of it reads as EOF.
 * pread(fd, buf, len, 0) is therefore always a fresh snapshot.
 *
 * Window statistics cover the samples taken since this open file's previous snapshot.
 *
 * Units: bytes, cycles and errors are cumulative 64-bit counters. Utilisation is a fixed-point
 * fraction of the link's capacity with NVLC_UTIL_ONE meaning 100 %; the utilisation of one
 * sample is the larger of its TX and RX rate. The stall rate of one sample is stall cycles
 * per microsecond of that sample.
 *
 * Histogram bucket 0 counts samples whose value is 0; bucket b (1 <= b < NVLC_HIST_BUCKETS - 1)
 * counts values v with 2^(b-1) <= v < 2^b; the last bucket counts everything >= 2^(B-2).
 */
#ifndef _UAPI_LINUX_NVLINK_COUNTER_H
#define _UAPI_LINUX_NVLINK_COUNTER_H

#include <linux/ioctl.h>
#include <linux/types.h>

/* "NVLC" as bytes in memory on a little-endian host. */
#define NVLC_MAGIC 0x434c564e
/* Major in the upper 16 bits, minor in the lower 16 bits. */
#define NVLC_ABI_VERSION 0x00010000
#define NVLC_ABI_MAJOR 1
#define NVLC_ABI_MINOR 0

#define NVLC_MAX_LINKS 512
#define NVLC_MAX_REGS 2560
#define NVLC_MAX_BARS 16
#define NVLC_NUM_COUNTERS 5
#define NVLC_HIST_BUCKETS 20
#define NVLC_UTIL_ONE 65536

/* Bounds of the sampling period (module parameter period_ns and NVLC_IOC_SET_PARAMS). */
#define NVLC_PERIOD_MIN_NS 10000
#define NVLC_PERIOD_MAX_NS 1000000000
#define NVLC_PERIOD_DEFAULT_NS 100000

/* Upper bounds of configured values, so that no fixed-point product can overflow. */
#define NVLC_MAX_CAPACITY_BPS 10000000000000
#define NVLC_MAX_SIM_RATE 10000000000000
#define NVLC_MAX_BURST_PCT 100000
#define NVLC_MAX_STALL_THRESHOLD 1000000000
#define NVLC_MAX_UTIL_THRESHOLD 1048576

/* Index of a counter in nvlc_record.counters[] and nvlc_mmio_reg.counter. */
#define NVLC_COUNTER_TX_BYTES 0
#define NVLC_COUNTER_RX_BYTES 1
#define NVLC_COUNTER_STALL_CYCLES 2
#define NVLC_COUNTER_REPLAY_ERRORS 3
#define NVLC_COUNTER_CRC_ERRORS 4

/* nvlc_header.source */
#define NVLC_SOURCE_NONE 0
#define NVLC_SOURCE_SIM 1
#define NVLC_SOURCE_MMIO 2

/* nvlc_header.flags */
#define NVLC_HDR_DEVICE_GONE 0x00000001
#define NVLC_HDR_THRESHOLD_EVENT 0x00000002
#define NVLC_HDR_MISSED_TICKS 0x00000004

/* nvlc_record.flags; bit (8 + NVLC_COUNTER_x) says counter x is read from the source. */
#define NVLC_LINK_DEVICE_GONE 0x00000001
#define NVLC_LINK_OVER_STALL 0x00000002
#define NVLC_LINK_OVER_UTIL 0x00000004
#define NVLC_LINK_COUNTER_SHIFT 8

/**
 * struct nvlc_header - start of every snapshot
 * @magic: NVLC_MAGIC
 * @abi_version: NVLC_ABI_VERSION of the writer
 * @header_size: bytes of this header, records start here
 * @record_size: bytes of one record, including tails unknown to older readers
 * @record_count: number of records that follow
 * @flags: NVLC_HDR_*
 * @source: NVLC_SOURCE_*
 * @reserved0: zero
 * @sequence: samples taken since the module was loaded
 * @ticks: sampling periods elapsed since load (sum of hrtimer overrun counts);
 *         ticks - sequence periods passed without a sample
 * @timestamp_ns: CLOCK_MONOTONIC time of the latest sample
 * @period_ns: sampling period now in force
 * @window_ns: time between the latest sample of this file's previous snapshot and this one's
 * @window_samples: samples taken in the window
 * @window_ticks: periods elapsed in the window
 * @stall_threshold: stall cycles per microsecond above which a sample counts as over
 * @util_threshold: utilisation (NVLC_UTIL_ONE = 100 %) above which a sample counts as over
 * @reserved: zero
 */
struct nvlc_header {
	__u32 magic;
	__u32 abi_version;
	__u32 header_size;
	__u32 record_size;
	__u32 record_count;
	__u32 flags;
	__u32 source;
	__u32 reserved0;
	__u64 sequence;
	__u64 ticks;
	__u64 timestamp_ns;
	__u64 period_ns;
	__u64 window_ns;
	__u64 window_samples;
	__u64 window_ticks;
	__u64 stall_threshold;
	__u64 util_threshold;
	__u64 reserved[3];
};

/**
 * struct nvlc_record - one (device, link)
 * @device: device index given by the configuration
 * @link: link index on that device
 * @flags: NVLC_LINK_*
 * @reserved0: zero
 * @capacity_bps: capacity in bytes per second per direction
 * @counters: cumulative counters, indexed by NVLC_COUNTER_*
 * @samples: samples that read this link since its source was configured
 * @window_samples: samples of this link in the window
 * @window_max_delta: largest per-sample increase of each counter in the window
 * @window_max_util: largest per-sample utilisation in the window
 * @window_max_stall: largest per-sample stall rate (cycles per microsecond) in the window
 * @window_over_stall: samples in the window whose stall rate was over the threshold
 * @window_over_util: samples in the window whose utilisation was over the threshold
 * @window_util_hist: log2 histogram of per-sample utilisation in the window
 * @window_stall_hist: log2 histogram of per-sample stall rate in the window
 * @util_hist: as @window_util_hist, since the source was configured
 * @stall_hist: as @window_stall_hist, since the source was configured
 * @reserved: zero
 */
struct nvlc_record {
	__u32 device;
	__u32 link;
	__u32 flags;
	__u32 reserved0;
	__u64 capacity_bps;
	__u64 counters[5];
	__u64 samples;
	__u64 window_samples;
	__u64 window_max_delta[5];
	__u64 window_max_util;
	__u64 window_max_stall;
	__u64 window_over_stall;
	__u64 window_over_util;
	__u64 window_util_hist[20];
	__u64 window_stall_hist[20];
	__u64 util_hist[20];
	__u64 stall_hist[20];
	__u64 reserved[4];
};

/**
 * struct nvlc_version - NVLC_IOC_GET_VERSION
 * @abi_version: NVLC_ABI_VERSION of the module
 * @header_size: sizeof(struct nvlc_header) of the module
 * @record_size: sizeof(struct nvlc_record) of the module
 * @max_links: NVLC_MAX_LINKS
 * @hist_buckets: NVLC_HIST_BUCKETS
 * @num_counters: NVLC_NUM_COUNTERS
 * @reserved: zero
 */
struct nvlc_version {
	__u32 abi_version;
	__u32 header_size;
	__u32 record_size;
	__u32 max_links;
	__u32 hist_buckets;
	__u32 num_counters;
	__u64 reserved[2];
};

/**
 * struct nvlc_params - NVLC_IOC_GET_PARAMS / NVLC_IOC_SET_PARAMS
 * @period_ns: sampling period, NVLC_PERIOD_MIN_NS..NVLC_PERIOD_MAX_NS
 * @stall_threshold: stall cycles per microsecond, 1..NVLC_MAX_STALL_THRESHOLD
 * @util_threshold: utilisation, 1..NVLC_MAX_UTIL_THRESHOLD (NVLC_UTIL_ONE = 100 %)
 * @reserved: zero
 */
struct nvlc_params {
	__u64 period_ns;
	__u64 stall_threshold;
	__u64 util_threshold;
	__u64 reserved[5];
};

/**
 * struct nvlc_sim_link - one synthetic link
 * @device: device index, below NVLC_MAX_LINKS
 * @link: link index, below NVLC_MAX_LINKS
 * @capacity_bps: bytes per second per direction, 1..NVLC_MAX_CAPACITY_BPS
 * @rate: increase per second of each counter, indexed by NVLC_COUNTER_*
 * @burst_period_ns: a burst starts every this many ns; 0 for none
 * @burst_len_ns: length of a burst, at most @burst_period_ns
 * @burst_pct: TX, RX and stall rates during a burst in percent of @rate, 100..NVLC_MAX_BURST_PCT
 * @reserved0: zero
 * @reserved: zero
 *
 * Counter c at t ns after configuration is rate[c] * t / 1e9 plus, for TX, RX and stall,
 * rate[c] * (burst_pct - 100) / 100 * (burst time before t) / 1e9: a pure function of t.
 */
struct nvlc_sim_link {
	__u32 device;
	__u32 link;
	__u64 capacity_bps;
	__u64 rate[5];
	__u64 burst_period_ns;
	__u64 burst_len_ns;
	__u32 burst_pct;
	__u32 reserved0;
	__u64 reserved[2];
};

/**
 * struct nvlc_sim_config - NVLC_IOC_SET_SIM
 * @nlinks: entries at @links, 1..NVLC_MAX_LINKS
 * @reserved0: zero
 * @links: user pointer to @nlinks struct nvlc_sim_link
 * @reserved: zero
 */
struct nvlc_sim_config {
	__u32 nlinks;
	__u32 reserved0;
	__u64 links;
	__u64 reserved[2];
};

/**
 * struct nvlc_mmio_link - a link read from registers
 * @device: device index, below NVLC_MAX_LINKS
 * @link: link index, below NVLC_MAX_LINKS
 * @capacity_bps: bytes per second per direction, 1..NVLC_MAX_CAPACITY_BPS
 * @reserved: zero
 */
struct nvlc_mmio_link {
	__u32 device;
	__u32 link;
	__u64 capacity_bps;
	__u64 reserved[2];
};

/**
 * struct nvlc_mmio_reg - one counter register
 * @domain: PCI domain of the device holding the register
 * @bus: PCI bus number, 0..255
 * @devfn: PCI device and function, (slot << 3) | function, 0..255
 * @bar: memory BAR, 0..5
 * @offset: byte offset in the BAR, aligned to the width, register within the BAR's length
 * @width: 32 or 64 (bits); 32-bit registers are extended to 64 bits across wraps
 * @counter: NVLC_COUNTER_* this register holds
 * @device: device index of a link declared in the same configuration
 * @link: link index of that link
 * @reserved: zero
 */
struct nvlc_mmio_reg {
	__u32 domain;
	__u32 bus;
	__u32 devfn;
	__u32 bar;
	__u64 offset;
	__u32 width;
	__u32 counter;
	__u32 device;
	__u32 link;
	__u64 reserved[2];
};

/**
 * struct nvlc_mmio_config - NVLC_IOC_SET_MMIO
 * @nlinks: entries at @links, 1..NVLC_MAX_LINKS
 * @nregs: entries at @regs, 1..NVLC_MAX_REGS
 * @links: user pointer to @nlinks struct nvlc_mmio_link
 * @regs: user pointer to @nregs struct nvlc_mmio_reg
 * @reserved: zero
 */
struct nvlc_mmio_config {
	__u32 nlinks;
	__u32 nregs;
	__u64 links;
	__u64 regs;
	__u64 reserved[2];
};

/* Not a registered ioctl type: the device node is private to this module. */
#define NVLC_IOC_MAGIC 0xB7

#define NVLC_IOC_GET_VERSION _IOR(NVLC_IOC_MAGIC, 0x00, struct nvlc_version)
#define NVLC_IOC_GET_PARAMS _IOR(NVLC_IOC_MAGIC, 0x01, struct nvlc_params)
#define NVLC_IOC_SET_PARAMS _IOW(NVLC_IOC_MAGIC, 0x02, struct nvlc_params)
#define NVLC_IOC_SET_SIM _IOW(NVLC_IOC_MAGIC, 0x03, struct nvlc_sim_config)
#define NVLC_IOC_SET_MMIO _IOW(NVLC_IOC_MAGIC, 0x04, struct nvlc_mmio_config)
#define NVLC_IOC_CLEAR_SOURCE _IO(NVLC_IOC_MAGIC, 0x05)

#endif /* _UAPI_LINUX_NVLINK_COUNTER_H */
