/* SPDX-License-Identifier: GPL-2.0 */
/* Internal declarations shared by the nvlink_counter source files. */
#ifndef NVLC_H
#define NVLC_H

#include <linux/list.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/spinlock.h>
#include <linux/types.h>
#include <linux/uidgid.h>
#include <linux/wait.h>

#include <uapi/linux/nvlink_counter.h>

#define NVLC_SNAPSHOT_MAX \
	(sizeof(struct nvlc_header) + NVLC_MAX_LINKS * sizeof(struct nvlc_record))

/* A mapped range of one memory BAR; registers point into it. */
struct nvlc_bar {
	struct pci_dev *pdev;
	unsigned int bar;
	u64 start;		/* first mapped byte offset in the BAR */
	u64 len;		/* mapped bytes */
	void __iomem *base;	/* NULL once the device is gone and unmapped */
	bool gone;		/* set under nvlc_lock; the timer never touches base after */
};

struct nvlc_reg {
	struct nvlc_bar *bar;
	void __iomem *addr;
	u32 width;
	u32 counter;
	u64 prev_raw;
	bool primed;
};

struct nvlc_link {
	u32 device;
	u32 link;
	u32 flags;		/* NVLC_LINK_* */
	u64 capacity;		/* bytes per second */
	u64 cum[NVLC_NUM_COUNTERS];
	u64 prev[NVLC_NUM_COUNTERS];
	u64 last_ns;		/* time of this link's previous sample */
	bool primed;
	u64 samples;
	u64 util_hist[NVLC_HIST_BUCKETS];
	u64 stall_hist[NVLC_HIST_BUCKETS];
	/* sim */
	struct nvlc_sim_link sim;
	/* mmio: registers of this link, NULL where the map has none */
	struct nvlc_reg *regs[NVLC_NUM_COUNTERS];
};

/* One configured source; replaced as a whole under nvlc_lock. */
struct nvlc_state {
	u32 source;
	u32 nlinks;
	u64 epoch_ns;		/* sim: time zero of the synthetic counters */
	struct nvlc_link *links;
	u32 nregs;
	struct nvlc_reg *regs;
	u32 nbars;
	struct nvlc_bar *bars;
};

/*
 * Window statistics of one link: per open file, and in the sampler's shared segment (the
 * samples since the segment was last folded into the open files' windows, nvlc_readers.c).
 */
struct nvlc_win {
	u64 samples;
	u64 max_delta[NVLC_NUM_COUNTERS];
	u64 max_util;
	u64 max_stall;
	u64 over_stall;
	u64 over_util;
	u64 util_hist[NVLC_HIST_BUCKETS];
	u64 stall_hist[NVLC_HIST_BUCKETS];
};

#define NVLC_SEGMENT_BYTES (NVLC_MAX_LINKS * sizeof(struct nvlc_win))

struct nvlc_file {
	struct list_head node;		/* on the readers list, under nvlc_readers_mutex */
	struct mutex read_lock;		/* the snapshot buffer */
	kuid_t uid;			/* real uid of the opener: whose quota this file counts in */
	u64 start_seq;
	u64 start_ticks;
	u64 start_ns;
	unsigned long event_seen;	/* nvlc_event_seq at the start of this file's window */
	size_t snap_len;
	u8 *snap;
	struct nvlc_win win[NVLC_MAX_LINKS];	/* under nvlc_readers_mutex */
};

/* Where the sampler stood at one instant: where a window starts or ends. */
struct nvlc_marks {
	u64 seq;
	u64 ticks;
	u64 ns;
	unsigned long event_seq;
};

/* Limits on open files, module parameters fixed at load (nvlc_main.c checks them). */
struct nvlc_limits {
	unsigned int max_open;		/* all readers together */
	unsigned int max_open_per_user;	/* one real uid other than root */
	unsigned int root_reserve;	/* of max_open, open files only root may take */
};

/* nvlc_sample.c */
extern spinlock_t nvlc_lock;
extern wait_queue_head_t nvlc_wq;
extern struct nvlc_state *nvlc_cur;
extern struct nvlc_win *nvlc_seg;
extern unsigned long nvlc_event_seq;
extern u64 nvlc_period_ns;
extern u64 nvlc_stall_threshold;
extern u64 nvlc_util_threshold;

int nvlc_sampler_start(u64 period_ns);
void nvlc_sampler_stop(void);
void nvlc_marks_locked(struct nvlc_marks *m);
void nvlc_sampler_stats(u64 *samples, u64 *busy_ns);
void nvlc_state_free(struct nvlc_state *s);
u64 nvlc_sim_value(const struct nvlc_sim_link *l, unsigned int counter, u64 t_ns);

/* nvlc_readers.c */
int nvlc_readers_init(const struct nvlc_limits *limits);
void nvlc_readers_exit(void);
int nvlc_reader_attach(struct nvlc_file *f);
void nvlc_reader_detach(struct nvlc_file *f);
int nvlc_snapshot(struct nvlc_file *f, u8 *buf, size_t *len);
bool nvlc_reader_event(const struct nvlc_file *f);
unsigned int nvlc_open_files(void);
struct nvlc_state *nvlc_swap_state(struct nvlc_state *next);

/* nvlc_mmio.c */
extern struct mutex nvlc_cfg_mutex;
int nvlc_mmio_build(const struct nvlc_mmio_link *links, u32 nlinks,
		    const struct nvlc_mmio_reg *regs, u32 nregs, struct nvlc_state *s);
void nvlc_mmio_release(struct nvlc_state *s);
bool nvlc_mmio_read_link(struct nvlc_link *l);
int nvlc_mmio_notifier_register(void);
void nvlc_mmio_notifier_unregister(void);

#endif /* NVLC_H */
