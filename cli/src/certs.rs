//! `flotilla certs`: a development CA and certificates for mTLS.
//!
//! `init` writes `ca.crt` and `ca.key`; `issue` writes `NAME.crt` and `NAME.key`, signed by
//! that CA, with the name in the subject CN and the role (`coordinator`, `worker`, `client`)
//! in the subject OU — which is what the coordinator reads to decide who may do what. Keys are
//! written readable by their owner only. Existing files are never overwritten without
//! `--force`.

use flotilla_proto::Problem;
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use flotilla_proto::tls::Role;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};

#[derive(Debug, Args)]
pub struct CertsArgs {
    #[command(subcommand)]
    command: CertsCommand,
}

#[derive(Debug, Subcommand)]
enum CertsCommand {
    /// Create a development CA (ca.crt, ca.key) in a directory.
    Init {
        #[arg(long, default_value = "pki")]
        dir: PathBuf,
        /// Days the CA is valid.
        #[arg(long, default_value_t = 3650)]
        days: u32,
        /// Replace existing files.
        #[arg(long)]
        force: bool,
    },
    /// Issue a certificate signed by the CA in the directory.
    Issue {
        #[arg(long, default_value = "pki")]
        dir: PathBuf,
        /// Name of the holder (certificate CN; a worker's name).
        #[arg(long)]
        name: String,
        /// What the holder may do: coordinator, worker or client.
        #[arg(long)]
        role: String,
        /// Host names and IP addresses the certificate is valid for (servers; repeatable).
        #[arg(long = "host")]
        hosts: Vec<String>,
        /// Days the certificate is valid.
        #[arg(long, default_value_t = 825)]
        days: u32,
        #[arg(long)]
        force: bool,
        /// A namespace a client acts in (repeatable; the first is where its launches go by
        /// default; `*`: every namespace, for operators). Written in the subject's O.
        #[arg(long = "namespace", value_name = "NS")]
        namespaces: Vec<String>,
    },
    /// Make what is missing of a CA and a set of certificates (idempotent: an init step of a
    /// deployment): the CA if there is none, then each NAME:ROLE without a certificate.
    Ensure {
        #[arg(long, default_value = "pki")]
        dir: PathBuf,
        /// A certificate to have: NAME:ROLE (repeatable), e.g. coordinator:coordinator.
        #[arg(long = "cert", value_name = "NAME:ROLE", required = true)]
        certs: Vec<String>,
        /// Host names and IP addresses the server certificates are valid for (repeatable).
        #[arg(long = "host")]
        hosts: Vec<String>,
    },
}

/// `certs ensure`: the CA and each `NAME:ROLE` certificate, made only where missing.
pub fn ensure(dir: &Path, wanted: &[String], hosts: &[String]) -> Result<String, Problem> {
    let mut made = Vec::new();
    if !dir.join("ca.crt").exists() {
        init(dir, 3650, false)?;
        made.push("ca".to_owned());
    }
    for w in wanted {
        let (name, role) = w.split_once(':').ok_or_else(|| {
            Problem::invalid(format!("--cert {w:?} is not NAME:ROLE, e.g. worker:worker"))
        })?;
        let role = role.parse::<Role>()?;
        if !dir.join(format!("{name}.crt")).exists() {
            issue(dir, name, role, hosts, 825, true)?;
            made.push(name.to_owned());
        }
    }
    Ok(if made.is_empty() {
        format!("{} has every certificate already", dir.display())
    } else {
        format!("made {} in {}", made.join(", "), dir.display())
    })
}

pub fn run(args: CertsArgs) -> i32 {
    let res = match args.command {
        CertsCommand::Init { dir, days, force } => init(&dir, days, force),
        CertsCommand::Issue {
            dir,
            name,
            role,
            hosts,
            days,
            force,
            namespaces,
        } => role
            .parse::<Role>()
            .and_then(|role| issue_in(&dir, &name, role, &hosts, days, force, &namespaces)),
        CertsCommand::Ensure { dir, certs, hosts } => ensure(&dir, &certs, &hosts),
    };
    match res {
        Ok(msg) => {
            println!("{msg}");
            0
        }
        Err(e) => crate::refuse(e),
    }
}

fn validity(params: &mut CertificateParams, days: u32) {
    let now = time::OffsetDateTime::now_utc();
    // An hour of slack for clocks that disagree a little.
    params.not_before = now - std::time::Duration::from_secs(3600);
    params.not_after = now + std::time::Duration::from_secs(u64::from(days) * 86_400);
}

fn write_new(path: &Path, body: &str, private: bool, force: bool) -> Result<(), Problem> {
    if path.exists() && !force {
        return Err(Problem::new(
            flotilla_proto::ErrorKind::Conflict,
            format!(
                "{} already exists; pass --force to replace it",
                path.display()
            ),
        ));
    }
    std::fs::write(path, body)
        .map_err(|e| Problem::internal(format!("cannot write {}: {e}", path.display())))?;
    if private {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| Problem::internal(format!("cannot restrict {}: {e}", path.display())))?;
    }
    Ok(())
}

pub fn init(dir: &Path, days: u32, force: bool) -> Result<String, Problem> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Problem::internal(format!("cannot create {}: {e}", dir.display())))?;
    let key = KeyPair::generate()
        .map_err(|e| Problem::internal(format!("cannot generate a key: {e}")))?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "Flotilla development CA");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut params, days);
    let ca = CertifiedIssuer::self_signed(params, key)
        .map_err(|e| Problem::internal(format!("cannot create the CA certificate: {e}")))?;
    write_new(&dir.join("ca.crt"), &ca.pem(), false, force)?;
    write_new(&dir.join("ca.key"), &ca.key().serialize_pem(), true, force)?;
    Ok(format!("wrote {0}/ca.crt and {0}/ca.key", dir.display()))
}

pub fn issue(
    dir: &Path,
    name: &str,
    role: Role,
    hosts: &[String],
    days: u32,
    force: bool,
) -> Result<String, Problem> {
    issue_in(dir, name, role, hosts, days, force, &[])
}

/// [`issue`], for a holder that acts in `namespaces` (a client's; none: `default`).
pub fn issue_in(
    dir: &Path,
    name: &str,
    role: Role,
    hosts: &[String],
    days: u32,
    force: bool,
    namespaces: &[String],
) -> Result<String, Problem> {
    for ns in namespaces {
        if ns != flotilla_proto::names::ALL_NAMESPACES
            && !flotilla_proto::names::valid_namespace(ns)
        {
            return Err(Problem::invalid(format!(
                "--namespace {ns:?} is not a namespace name: 1 to 63 lower-case letters, digits, - _ and . (or * for all)"
            )));
        }
    }
    if namespaces.len() > 1
        && namespaces
            .iter()
            .any(|n| n == flotilla_proto::names::ALL_NAMESPACES)
    {
        return Err(Problem::invalid(
            "--namespace '*' already means every namespace: give it alone",
        ));
    }
    if !namespaces.is_empty() && role != Role::Client {
        return Err(Problem::invalid(format!(
            "--namespace is for client certificates; a {} certificate acts in every namespace",
            role.as_str()
        )));
    }
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err(Problem::invalid(format!(
            "{name:?} is not a usable name: use letters, digits, '-', '_' and '.'"
        )));
    }
    let read = |f: &str| {
        std::fs::read_to_string(dir.join(f)).map_err(|e| {
            Problem::invalid(format!(
                "cannot read {}: {e}; create the CA first with `flotilla certs init --dir {}`",
                dir.join(f).display(),
                dir.display()
            ))
        })
    };
    let ca_key = KeyPair::from_pem(&read("ca.key")?)
        .map_err(|e| Problem::invalid(format!("ca.key is not a private key: {e}")))?;
    let issuer = Issuer::from_ca_cert_pem(&read("ca.crt")?, ca_key)
        .map_err(|e| Problem::invalid(format!("ca.crt is not a CA certificate: {e}")))?;
    let mut sans: Vec<String> = hosts.to_vec();
    if sans.is_empty() {
        sans = match role {
            Role::Coordinator => vec!["localhost".into(), "127.0.0.1".into()],
            _ => vec![name.to_owned()],
        };
    }
    let mut params =
        CertificateParams::new(sans).map_err(|e| Problem::invalid(format!("bad --host: {e}")))?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    dn.push(DnType::OrganizationalUnitName, role.as_str());
    if !namespaces.is_empty() {
        dn.push(DnType::OrganizationName, namespaces.join(","));
    }
    params.distinguished_name = dn;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = match role {
        Role::Coordinator => vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ],
        _ => vec![ExtendedKeyUsagePurpose::ClientAuth],
    };
    params.use_authority_key_identifier_extension = true;
    validity(&mut params, days);
    let key =
        KeyPair::generate().map_err(|e| Problem::invalid(format!("cannot generate a key: {e}")))?;
    let cert = params
        .signed_by(&key, &issuer)
        .map_err(|e| Problem::invalid(format!("cannot sign the certificate: {e}")))?;
    write_new(&dir.join(format!("{name}.crt")), &cert.pem(), false, force)?;
    write_new(
        &dir.join(format!("{name}.key")),
        &key.serialize_pem(),
        true,
        force,
    )?;
    let spaces = if namespaces.is_empty() {
        String::new()
    } else {
        format!(", namespaces {}", namespaces.join(", "))
    };
    Ok(format!(
        "wrote {0}/{name}.crt and {0}/{name}.key (role {1}{spaces})",
        dir.display(),
        role.as_str()
    ))
}
