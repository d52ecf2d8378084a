//! The system calls an agent may not make, as a seccomp filter bubblewrap installs just before
//! it starts the agent's program (`bwrap --seccomp FD`).
//!
//! What no agent tool needs and a hostile agent would use to break out or reach the host is
//! refused with `EPERM`: mounts and new namespaces (also through `clone` flags), kernel
//! keyrings, `bpf`, `perf_event_open`, `ptrace` and other processes' memory, `userfaultfd`,
//! `io_uring`, kernel modules and `kexec`, setting the clocks, swap, reboot, accounting,
//! quotas, file handles (`open_by_handle_at`), the kernel log, `TIOCSTI`. `clone3` answers
//! `ENOSYS` (its flags are out of a filter's reach; the C library then falls back to `clone`,
//! whose flags are checked). Everything else is allowed: the sandbox's namespaces and mounts
//! do the confining, this takes away the kernel surface behind them.
//!
//! The program is written here rather than with a filter compiler because a deny list must
//! also refuse the x32 system call numbers (bit 30 set on x86-64), which a compiler keyed by
//! system call number cannot say; it is short: an architecture check, one comparison per
//! call, two argument checks. A process of another architecture than the worker's is killed.

use nix::libc;

/// One BPF instruction, as the kernel reads it (`struct sock_filter`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Insn {
    code: u16,
    jt: u8,
    jf: u8,
    k: u32,
}

const LD_W_ABS: u16 = 0x20;
const JEQ_K: u16 = 0x15;
const JGE_K: u16 = 0x35;
const JSET_K: u16 = 0x45;
const RET_K: u16 = 0x06;

const RET_ALLOW: u32 = 0x7fff_0000;
const RET_KILL_PROCESS: u32 = 0x8000_0000;
const RET_ERRNO: u32 = 0x0005_0000;

/// Offsets in `struct seccomp_data`: the call's number, the architecture, the arguments
/// (each 64 bits; their low half first on the little-endian machines this runs on).
const NR: u32 = 0;
const ARCH: u32 = 4;
const fn arg_low(i: u32) -> u32 {
    16 + 8 * i
}

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xc000_00b7;
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const AUDIT_ARCH: u32 = 0;

/// The x32 ABI's system calls have this bit set in their number.
const X32_BIT: u32 = 0x4000_0000;

/// `clone` flags that make namespaces.
const NEW_NAMESPACES: u32 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWCGROUP
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | 0x0000_0080/* CLONE_NEWTIME */) as u32;

/// System calls refused with `EPERM`, where this architecture has them.
fn denied() -> Vec<libc::c_long> {
    let mut calls = vec![
        libc::SYS_mount,
        libc::SYS_umount2,
        libc::SYS_pivot_root,
        libc::SYS_chroot,
        libc::SYS_unshare,
        libc::SYS_setns,
        libc::SYS_fsopen,
        libc::SYS_fsconfig,
        libc::SYS_fsmount,
        libc::SYS_fspick,
        libc::SYS_move_mount,
        libc::SYS_open_tree,
        libc::SYS_mount_setattr,
        libc::SYS_keyctl,
        libc::SYS_add_key,
        libc::SYS_request_key,
        libc::SYS_bpf,
        libc::SYS_perf_event_open,
        libc::SYS_ptrace,
        libc::SYS_process_vm_readv,
        libc::SYS_process_vm_writev,
        libc::SYS_kcmp,
        libc::SYS_userfaultfd,
        libc::SYS_io_uring_setup,
        libc::SYS_io_uring_enter,
        libc::SYS_io_uring_register,
        libc::SYS_init_module,
        libc::SYS_finit_module,
        libc::SYS_delete_module,
        libc::SYS_kexec_load,
        libc::SYS_kexec_file_load,
        libc::SYS_clock_settime,
        libc::SYS_clock_adjtime,
        libc::SYS_settimeofday,
        libc::SYS_adjtimex,
        libc::SYS_swapon,
        libc::SYS_swapoff,
        libc::SYS_reboot,
        libc::SYS_acct,
        libc::SYS_quotactl,
        libc::SYS_open_by_handle_at,
        libc::SYS_name_to_handle_at,
        libc::SYS_syslog,
        libc::SYS_vhangup,
        libc::SYS_lookup_dcookie,
    ];
    #[cfg(target_arch = "x86_64")]
    calls.extend([
        libc::SYS_iopl,
        libc::SYS_ioperm,
        libc::SYS_uselib,
        libc::SYS_ustat,
        libc::SYS_sysfs,
        libc::SYS__sysctl,
    ]);
    calls
}

/// Labels of the program's shared tails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum To {
    Next,
    Allow,
    Kill,
    Eperm,
    Enosys,
    CloneFlags,
    IoctlCmd,
}

/// The filter as the bytes `bwrap --seccomp` reads: the instructions one after another in
/// the machine's order. `None` on an architecture this does not know (agents then run
/// without one, and the worker says so).
pub fn program() -> Option<Vec<u8>> {
    if cfg!(not(any(target_arch = "x86_64", target_arch = "aarch64"))) {
        return None;
    }
    let mut out = Vec::new();
    for i in instructions() {
        out.extend_from_slice(&i.code.to_ne_bytes());
        out.push(i.jt);
        out.push(i.jf);
        out.extend_from_slice(&i.k.to_ne_bytes());
    }
    Some(out)
}

/// One instruction with symbolic jumps.
type Sym = (u16, To, To, u32);

fn instructions() -> Vec<Insn> {
    let mut body: Vec<Sym> = vec![
        (LD_W_ABS, To::Next, To::Next, ARCH),
        // Another architecture (i386 calls on x86-64, say) dies: its numbers mean other calls.
        (JEQ_K, To::Next, To::Kill, AUDIT_ARCH),
        (LD_W_ABS, To::Next, To::Next, NR),
        (JGE_K, To::Eperm, To::Next, X32_BIT),
        (JEQ_K, To::Enosys, To::Next, libc::SYS_clone3 as u32),
        (JEQ_K, To::CloneFlags, To::Next, libc::SYS_clone as u32),
        (JEQ_K, To::IoctlCmd, To::Next, libc::SYS_ioctl as u32),
    ];
    for nr in denied() {
        body.push((JEQ_K, To::Eperm, To::Next, nr as u32));
    }
    // What passes every check.
    body.push((RET_K, To::Next, To::Next, RET_ALLOW));
    // The tails. BPF jumps only go forward: the argument checks come before the returns
    // they jump to.
    let tails: [(To, Vec<Sym>); 6] = [
        (
            To::CloneFlags,
            vec![
                (LD_W_ABS, To::Next, To::Next, arg_low(0)),
                (JSET_K, To::Eperm, To::Allow, NEW_NAMESPACES),
            ],
        ),
        (
            To::IoctlCmd,
            vec![
                (LD_W_ABS, To::Next, To::Next, arg_low(1)),
                (JEQ_K, To::Eperm, To::Next, libc::TIOCSTI as u32),
                (JEQ_K, To::Eperm, To::Allow, libc::TIOCLINUX as u32),
            ],
        ),
        (To::Allow, vec![(RET_K, To::Next, To::Next, RET_ALLOW)]),
        (
            To::Kill,
            vec![(RET_K, To::Next, To::Next, RET_KILL_PROCESS)],
        ),
        (
            To::Eperm,
            vec![(RET_K, To::Next, To::Next, RET_ERRNO | libc::EPERM as u32)],
        ),
        (
            To::Enosys,
            vec![(RET_K, To::Next, To::Next, RET_ERRNO | libc::ENOSYS as u32)],
        ),
    ];
    let mut at = std::collections::HashMap::new();
    let mut flat = body;
    for (label, insns) in tails {
        at.insert(label, flat.len());
        flat.extend(insns);
    }
    // Jumps only go forward, by at most 255: the list of calls is far shorter than that.
    let offset = |from: usize, to: To| -> u8 {
        match to {
            To::Next => 0,
            label => u8::try_from(at[&label] - from - 1).unwrap_or(u8::MAX),
        }
    };
    flat.iter()
        .enumerate()
        .map(|(i, (code, jt, jf, k))| Insn {
            code: *code,
            jt: offset(i, *jt),
            jf: offset(i, *jf),
            k: *k,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the program the way the kernel does, on one call.
    fn verdict(nr: u32, arch: u32, args: [u64; 6]) -> u32 {
        let prog = instructions();
        let mut data = Vec::new();
        data.extend_from_slice(&nr.to_ne_bytes());
        data.extend_from_slice(&arch.to_ne_bytes());
        data.extend_from_slice(&0u64.to_ne_bytes());
        for a in args {
            data.extend_from_slice(&a.to_ne_bytes());
        }
        let (mut pc, mut acc) = (0usize, 0u32);
        loop {
            let i = prog[pc];
            match i.code {
                LD_W_ABS => {
                    let o = i.k as usize;
                    acc = u32::from_ne_bytes(data[o..o + 4].try_into().unwrap());
                    pc += 1;
                }
                RET_K => return i.k,
                JEQ_K | JGE_K | JSET_K => {
                    let hit = match i.code {
                        JEQ_K => acc == i.k,
                        JGE_K => acc >= i.k,
                        _ => acc & i.k != 0,
                    };
                    pc += 1 + usize::from(if hit { i.jt } else { i.jf });
                }
                other => panic!("unknown instruction {other:#x}"),
            }
        }
    }

    const EPERM: u32 = RET_ERRNO | libc::EPERM as u32;

    #[test]
    fn the_filter_refuses_what_it_lists_and_allows_the_rest() {
        let call = |nr: libc::c_long| verdict(nr as u32, AUDIT_ARCH, [0; 6]);
        for nr in denied() {
            assert_eq!(call(nr), EPERM, "call {nr}");
        }
        for nr in [
            libc::SYS_read,
            libc::SYS_write,
            libc::SYS_openat,
            libc::SYS_execve,
            libc::SYS_wait4,
            libc::SYS_socket,
            libc::SYS_mmap,
        ] {
            assert_eq!(call(nr), RET_ALLOW, "call {nr}");
        }
        assert_eq!(call(libc::SYS_clone3), RET_ERRNO | libc::ENOSYS as u32);
        // x32 numbers never pass, whatever they would be.
        let x32_mount = X32_BIT | libc::SYS_mount as u32;
        assert_eq!(verdict(x32_mount, AUDIT_ARCH, [0; 6]), EPERM);
        assert_eq!(verdict(X32_BIT, AUDIT_ARCH, [0; 6]), EPERM);
        // Another architecture is killed.
        assert_eq!(verdict(21, 0x4000_0003, [0; 6]), RET_KILL_PROCESS);
    }

    #[test]
    fn clone_may_make_threads_and_processes_but_no_namespace() {
        let clone =
            |flags: u64| verdict(libc::SYS_clone as u32, AUDIT_ARCH, [flags, 0, 0, 0, 0, 0]);
        let thread = (libc::CLONE_VM
            | libc::CLONE_FS
            | libc::CLONE_FILES
            | libc::CLONE_SIGHAND
            | libc::CLONE_THREAD
            | libc::CLONE_SYSVSEM
            | libc::CLONE_SETTLS
            | libc::CLONE_PARENT_SETTID
            | libc::CLONE_CHILD_CLEARTID) as u64;
        assert_eq!(clone(thread), RET_ALLOW);
        assert_eq!(clone(libc::SIGCHLD as u64), RET_ALLOW);
        for ns in [
            libc::CLONE_NEWUSER,
            libc::CLONE_NEWNS,
            libc::CLONE_NEWNET,
            libc::CLONE_NEWPID,
            libc::CLONE_NEWCGROUP,
            0x80,
        ] {
            assert_eq!(clone(ns as u64 | libc::SIGCHLD as u64), EPERM, "{ns:#x}");
        }
        let ioctl = |cmd: u64| verdict(libc::SYS_ioctl as u32, AUDIT_ARCH, [0, cmd, 0, 0, 0, 0]);
        assert_eq!(ioctl(libc::TIOCSTI), EPERM);
        assert_eq!(ioctl(libc::TIOCGWINSZ), RET_ALLOW);
    }

    #[test]
    fn every_jump_lands_inside_the_program_and_it_ends_in_returns() {
        let prog = instructions();
        for (i, insn) in prog.iter().enumerate() {
            if matches!(insn.code, JEQ_K | JGE_K | JSET_K) {
                assert!(i + 1 + usize::from(insn.jt) < prog.len(), "{i}: {insn:?}");
                assert!(i + 1 + usize::from(insn.jf) < prog.len(), "{i}: {insn:?}");
            }
        }
        assert_eq!(prog.last().map(|i| i.code), Some(RET_K));
        assert_eq!(program().unwrap().len(), prog.len() * 8);
        assert!(prog.len() < 4096);
    }
}
